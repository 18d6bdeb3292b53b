"""Stub: textworld imports jericho at import time; ALFWorld games never use it."""
class FrotzEnv:  # noqa
    def __init__(self, *a, **k):
        raise RuntimeError("jericho stub: Z-machine games are not supported here")
class UnsupportedGameWarning(UserWarning):
    pass
class TruncatedInputActionWarning(UserWarning):
    pass
def __getattr__(name):
    if name.endswith("Warning"):
        return type(name, (UserWarning,), {})
    raise AttributeError(name)
