"""qmtp.bench.sampling_ops: every piece of a sampled round is timed for each batch size, and the round's
extra is the sampled round's time less the greedy round's (a CPU smoke run at a small vocabulary)."""

from qmtp.bench import sampling_ops


def test_each_piece_is_timed_per_rows_and_the_round_extra_is_their_difference():
    lines = []
    rows = sampling_ops.run([1, 2], vocab=512, k=2, iters=1, trials=1, show=lines.append)
    names = list(sampling_ops.pieces(1, 2)) + ["round_extra"]
    assert [(r["rows"], r["piece"]) for r in rows] == [(b, n) for b in (1, 2) for n in names]
    assert "logprobs_3_positions" in names and len(lines) == len(rows)
    for b in (1, 2):
        us = {r["piece"]: r["us_per_call"] for r in rows if r["rows"] == b}
        assert all(v > 0 for name, v in us.items() if name != "round_extra"), us
        assert us["round_extra"] == us["round_sampled"] - us["round_greedy"]
