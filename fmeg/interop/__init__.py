"""Conversions between fmeg parameter pytrees and other libraries' models."""
