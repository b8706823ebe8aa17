"""``NAME:key=value,...`` variant specs of the benchmarks' command lines, one parser for all of them."""

from __future__ import annotations


def parse_variant(spec: str, option: str) -> tuple[str, dict[str, int | float | bool | str]]:
    """The variant's name and its settings (integers, floats and true/false parsed, other values kept as
    strings); a malformed item stops the run with one line naming ``option`` and the spec."""
    name, _, fields = spec.partition(":")
    settings: dict[str, int | float | bool | str] = {}
    for item in filter(None, fields.split(",")):
        key, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"{option} {spec!r}: {item!r} is not field=value")
        settings[key] = _value(text)
    return name, settings


def _value(text: str) -> int | float | bool | str:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)
