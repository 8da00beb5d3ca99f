"""What each value of a job description may hold, checked where it is defined (``jobspec``), so no
value reaches an sbatch script or a manifest unchecked: names a scheduler reads are held to what
it accepts; free text is quoted where it is written and must be one line (a line break in a
``#SBATCH`` line would start a line that bash runs as a command).
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from .._check import short as shown
from ..errors import ConfigError

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # a tab is the one control character a line may hold
#: SLURM's partition, account and QOS names (no whitespace, no shell or sbatch syntax).
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]+")
#: RFC 1123 labels, as Kubernetes names namespaces and services.
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: What sbatch reads as it is: anything else is quoted (``sbatch_arg``).
_SBATCH_PLAIN = re.compile(r"[\w@%+=:,./-]+")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")

#: A field's annotation -> what its value must be.
_KINDS = {"str": "a string", "int": "a whole number", "bool": "true or false", "tuple[str, ...]": "a list of strings",
          "dict[str, str]": 'a table of NAME = "value"'}
#: How a job file writes a value of each kind, and of the keys whose example says more.
_WRITE = {"str": '"..." (in quotes)', "int": "2 (no quotes)", "bool": "true or false (no quotes)",
          "tuple[str, ...]": '["...", "..."]', "dict[str, str]": 'a table: [env] then lines NAME = "value"'}
_EXAMPLES = {"command": '["train.py", "--lr", "0.1"]', "dtrain": '["python3", "-m", "dtrain"]', "time": '"02:00:00"',
             "mem_per_proc": '"4G"', "name": '"mnist-2n"', "setup": '["source .venv/bin/activate"]',
             "port": "29500 (no quotes)", "extra": '["--exclusive"]', "image": '"registry.example.com/me/train:1"', "env": '{ NCCL_DEBUG = "WARN" }'}


def check_types(obj: Any, label: str = "") -> None:
    """Every field of the dataclass ``obj`` holds the type its annotation names (a bool is not a
    whole number, a string is not true or false); ``label`` prefixes the key, e.g. ``[slurm] ``."""
    for f in fields(obj):
        kind = str(f.type)
        optional = kind.endswith(" | None")
        base = kind.removesuffix(" | None")
        value = getattr(obj, f.name)
        if base not in _KINDS or (optional and value is None):
            continue
        bad = _wrong_part(value, base)
        if bad is not None:
            key, part = (f.name, value) if bad == "" else (f"{f.name}{bad[0]}", bad[1])
            example = _EXAMPLES.get(f.name, _WRITE[base])
            raise ConfigError(f"{label}{key} must be {'a string' if bad else _KINDS[base]}, got {shown(part)} "
                              f"({type(part).__name__}); write e.g. {f.name} = {example}.")


def _wrong_part(value: Any, kind: str) -> Any:
    """None when ``value`` is of ``kind``; ``""`` when the value itself is not; ``(where, part)``
    for the first wrong element of a list or table."""
    plain = {"str": str, "int": int, "bool": bool}.get(kind)
    if plain is not None:
        return None if isinstance(value, plain) and not (plain is int and isinstance(value, bool)) else ""
    if kind == "tuple[str, ...]":
        if not isinstance(value, (tuple, list)):
            return ""
        return next(((f"[{i}]", v) for i, v in enumerate(value) if not isinstance(v, str)), None)
    if not isinstance(value, dict):
        return ""
    return next(((f".{k}", v) for k, v in value.items() if not isinstance(k, str) or not isinstance(v, str)), None)


def one_line(what: str, text: str) -> str:
    """``text`` without line breaks or other control characters (free text that a script quotes)."""
    if _CONTROL.search(text):
        raise ConfigError(f"{what} {shown(text)} holds a line break or another control character; write it on one line.")
    return text


def not_empty(what: str, text: str) -> str:
    if not text.strip():
        raise ConfigError(f"{what} is empty; give a value or leave the key out.")
    return text


def slurm_name(what: str, text: str, *, several: bool = False) -> str:
    """A partition, account or QOS name as sbatch takes it (``several``: a comma-separated list)."""
    parts = text.split(",") if several else [text]
    if not all(_SLURM_NAME.fullmatch(p) for p in parts):
        listed = ", names separated by ','" if several else ""
        raise ConfigError(f"{what} {shown(text)} is not a SLURM name; use letters, digits, '_', '.' and '-'{listed} "
                          '(e.g. "gpu"), as `sinfo`/`sacctmgr` list them.')
    return text


def dns_label(what: str, text: str, *, limit: int = 63) -> str:
    """A Kubernetes name (RFC 1123 label): lower-case letters, digits and '-', at most ``limit``."""
    if not _DNS_LABEL.fullmatch(text) or len(text) > limit:
        raise ConfigError(f"{what} {shown(text)} is not a Kubernetes name; use lower-case letters, digits and '-', "
                          f"starting and ending with a letter or digit, at most {limit} characters.")
    return text


def env_key(what: str, key: str) -> str:
    if not _ENV_KEY.fullmatch(key):
        raise ConfigError(f"{what} {shown(key)} is not an environment variable name; use letters, digits and '_', "
                          "not starting with a digit (e.g. NCCL_DEBUG).")
    return key


def in_range(what: str, value: int, low: int, high: int, fix: str) -> int:
    if not low <= value <= high:
        raise ConfigError(f"{what} must be within {low}..{high}, got {value}; {fix}.")
    return value


def sbatch_option(what: str, text: str) -> str:
    """One sbatch option as on its command line (``--exclusive``, ``--constraint=a100``)."""
    one_line(what, text)
    if not text.startswith("-"):
        raise ConfigError(f"{what} {shown(text)} is not an sbatch option; write one option per item as on sbatch's "
                          'command line, e.g. extra = ["--exclusive", "--constraint=a100"].')
    return text


def sbatch_arg(option: str) -> str:
    """``option`` as one argument of a ``#SBATCH`` line. sbatch (not the shell) reads it: it splits at
    whitespace, takes quotes and backslash escapes, and ends the line at an unquoted '#'
    (``src/sbatch/opt.c``); double quotes with ``\\``, ``"`` and ``#`` escaped read back as ``option``."""
    if _SBATCH_PLAIN.fullmatch(option):
        return option
    return '"' + re.sub(r'([\\"#])', r"\\\1", option) + '"'


def comment(text: str) -> str:
    """``text`` for a comment line of a script: control characters written as escapes."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)
