class Conflict(Exception):
    """The request is well-formed but conflicts with the current state (HTTP 409)."""

    def __init__(self, message: str, *, code: str = "conflict") -> None:
        super().__init__(message)
        self.code = code
