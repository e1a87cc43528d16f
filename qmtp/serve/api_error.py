"""The OpenAI-style error a request gets: APIError (raised while checking a request) and its body,
{"error": {"message", "type", "param", "code"}} (qmtp/serve/protocol.py lists the statuses)."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid(param: str, problem: str) -> APIError:
    """400 invalid_value naming param (a dotted path such as tools[2].function.name)."""
    return APIError(400, f"{param}: {problem}", param=param, code="invalid_value")
