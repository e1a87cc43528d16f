"""qmtp.xla_defaults: the XLA settings qmtp adds to XLA_FLAGS on import, never over the user's."""

import os

from qmtp import xla_defaults


def test_defaults_are_appended_to_what_the_user_set():
    assert xla_defaults.with_defaults("") == "--xla_gpu_dot_merger_threshold_mb=0"
    assert xla_defaults.with_defaults(" --xla_force_host_platform_device_count=2 ") == (
        "--xla_force_host_platform_device_count=2 --xla_gpu_dot_merger_threshold_mb=0")


def test_a_flag_the_user_named_is_left_as_set():
    user = "--xla_gpu_dot_merger_threshold_mb=32 --xla_force_host_platform_device_count=2"
    assert xla_defaults.with_defaults(user) == user
    assert xla_defaults.with_defaults("xla_gpu_dot_merger_threshold_mb=1") == "xla_gpu_dot_merger_threshold_mb=1"


def test_apply_sets_the_environment_and_importing_qmtp_applied_it():
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert xla_defaults.apply(env) == "--xla_dump_to=/tmp/x --xla_gpu_dot_merger_threshold_mb=0"
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_dot_merger_threshold_mb=0"
    assert xla_defaults.apply({}) == "--xla_gpu_dot_merger_threshold_mb=0"
    import qmtp  # noqa: F401  (its import ran apply on this process's environment)
    assert "xla_gpu_dot_merger_threshold_mb" in os.environ["XLA_FLAGS"]
