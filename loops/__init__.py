"""Loop compositions over the engine's pure steps (fit, validate, test, predict)."""

__all__: list[str] = []
