"""What every app's API answers through: the error answer and the JSON parser and renderer."""
