"""Lock keys derived from a task's arguments, made safe for the wire protocol.

A key comes from a format template over the task's bound arguments, defaults applied
(``"report:{customer_id}"``); a callable taking the task's arguments; or nothing: the task
name plus a stable digest of the canonical JSON of all bound arguments (kombu's encoder, so
UUIDs, dates and Decimals work).

`safe_key` turns the result into a key the server accepts (no whitespace, at most
``MAX_LINE_BYTES`` bytes); a key that needs changing keeps a readable prefix and gains a
digest of the original, so two different raw keys never collapse into one.
"""

from __future__ import annotations

import hashlib
import inspect
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, cast

from kombu.utils.json import JSONEncoder

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.client.wire import MAX_LINE_BYTES

KeySource = str | Callable[..., str] | None
"""What ``lock_key`` may be: a format template, a callable, or None (the default key)."""

DIGEST_SEPARATOR: Final = "#"
"""Joins a readable prefix and the digest of the original key."""
_DIGEST_BYTES: Final = 16
_CANONICAL: Final = JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_UNSAFE = re.compile(r"\s+")  # the protocol forbids space, tab, CR, LF; other spaces confuse logs


class KeyDerivationError(InvalidValueError):
    """A lock key could not be built from the task's arguments (the message says why)."""


def digest(data: str) -> str:
    """A stable 32-character hex digest of ``data`` (BLAKE2b, 128 bits); lone surrogates (a
    file name that is not UTF-8, as ``os.fsdecode`` gives it) are digested as they are."""
    encoded = data.encode("utf-8", errors="surrogatepass")
    return hashlib.blake2b(encoded, digest_size=_DIGEST_BYTES).hexdigest()


def safe_key(raw: str) -> str:
    """Return ``raw`` if the protocol accepts it as a key (non-empty, no whitespace, at most
    ``MAX_LINE_BYTES`` bytes of UTF-8, no lone surrogate), else ``<readable prefix>#<digest of
    raw>`` (a lone surrogate shown as ``?`` in the prefix)."""
    try:
        size = len(raw.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        size = MAX_LINE_BYTES + 1
    if raw and size <= MAX_LINE_BYTES and not _UNSAFE.search(raw):
        return raw
    budget = MAX_LINE_BYTES - len(DIGEST_SEPARATOR) - 2 * _DIGEST_BYTES  # hex digits
    # The longest prefix whose UTF-8 fits (a character cut in two is dropped).
    text = _UNSAFE.sub("_", raw).encode("utf-8", errors="replace")
    prefix = text[:budget].decode("utf-8", errors="ignore")
    return f"{prefix}{DIGEST_SEPARATOR}{digest(raw)}"


class _NamedParameters:
    """A signature whose parameters all have names (no ``*args``/``**kwargs``/positional-only):
    `bind` gives what ``signature.bind(...)`` + ``apply_defaults()`` give, faster, or None
    when that would fail."""

    __slots__ = ("names", "parameters", "positional")

    def __init__(self, positional: tuple[str, ...], parameters: tuple[tuple[str, Any], ...]):
        self.positional = positional
        self.parameters = parameters  # (name, default or Parameter.empty), in order
        self.names = frozenset(name for name, _ in parameters)

    @classmethod
    def of(cls, signature: inspect.Signature) -> _NamedParameters | None:
        positional: list[str] = []
        parameters: list[tuple[str, Any]] = []
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
                positional.append(parameter.name)
            elif parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
                return None
            parameters.append((parameter.name, parameter.default))
        return cls(tuple(positional), tuple(parameters))

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        if len(args) > len(self.positional):
            return None
        given = dict(zip(self.positional, args, strict=False))
        for name in kwargs:
            if name in given or name not in self.names:
                return None
        bound: dict[str, Any] = {}
        empty = inspect.Parameter.empty
        for name, default in self.parameters:
            if name in given:
                bound[name] = given[name]
            elif name in kwargs:
                bound[name] = kwargs[name]
            elif default is not empty:
                bound[name] = default
            else:
                return None  # a required argument is missing
        return bound


def default_key(task_name: str, arguments: Mapping[str, Any]) -> str:
    """``<task name>:<digest of the canonical JSON of the bound arguments>``."""
    try:
        canonical = _CANONICAL.encode(dict(arguments))
    except (TypeError, ValueError) as exc:
        raise KeyDerivationError(
            f"cannot build the default lock key of task {task_name!r}: its arguments are "
            f"not JSON-serialisable ({exc}); set lock_key to a template or a callable"
        ) from exc
    return f"{task_name}:{digest(canonical)}"


def check_template(template: str, run: Callable[..., Any], *, task_name: str) -> None:
    """Raise `KeyDerivationError` if ``template`` names a field ``run`` does not take."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise KeyDerivationError(
            f"lock_key template {template!r} of task {task_name!r} is not a valid format "
            f"string: {exc}"
        ) from exc
    try:
        signature = inspect.signature(run)
    except (TypeError, ValueError):
        return
    for field in fields:
        head = re.split(r"[.\[]", field, maxsplit=1)[0]
        if head.isdigit() or head == "":
            raise KeyDerivationError(
                f"lock_key template {template!r} of task {task_name!r} uses a positional "
                f"field {{{field}}}; name the argument instead (e.g. {{customer_id}})"
            )
        if head not in signature.parameters:
            short = task_name.rpartition(".")[2]
            empty = inspect.Parameter.empty  # the signature without annotations
            bare = signature.replace(
                parameters=[p.replace(annotation=empty) for p in signature.parameters.values()],
                return_annotation=empty,
            )
            raise KeyDerivationError(
                f"lock_key template {template!r} of task {task_name!r} refers to {{{head}}}, "
                f"which is not an argument of the task: its signature is "
                f"{short}{bare}; name one of its arguments in the template"
            )


class KeyBuilder:
    """Builds the protocol-safe lock keys of one task's runs: ``source`` is the resolved
    ``lock_key`` option, ``prefix`` (``dflock_key_prefix``) goes in front of every key. The
    signature is inspected once, here; `key` does the per-run part."""

    __slots__ = ("_named", "_signature", "prefix", "run", "source", "task_name")

    def __init__(
        self, source: KeySource, *, task_name: str, run: Callable[..., Any], prefix: str = ""
    ) -> None:
        self.source = source
        self.run = run  # what it was built for, with source and prefix
        self.task_name = task_name
        self.prefix = prefix
        try:
            self._signature = None if callable(source) else inspect.signature(run)
        except (TypeError, ValueError):  # it has none (e.g. a C function)
            self._signature = None
        self._named = None if self._signature is None else _NamedParameters.of(self._signature)

    def key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The protocol-safe lock key of the run called with ``args`` and ``kwargs``."""
        source, task_name, prefix = self.source, self.task_name, self.prefix
        if callable(source):
            try:
                raw = cast("object", source(*args, **kwargs))
            except TypeError as exc:
                raise KeyDerivationError(
                    f"lock_key callable {source!r} of task {task_name!r} failed: {exc}; it "
                    f"must accept the same arguments as the task"
                ) from exc
            if not isinstance(raw, str):
                raise KeyDerivationError(
                    f"lock_key callable {source!r} of task {task_name!r} returned "
                    f"{type(raw).__name__}, expected str"
                )
            return safe_key(prefix + raw)
        arguments = self._arguments(args, kwargs)
        if source is None:
            return safe_key(prefix + default_key(task_name, arguments))
        try:  # the template (``"report:{customer_id}"``) over the bound arguments
            raw = source.format_map(dict(arguments))
        except (LookupError, AttributeError, TypeError, ValueError) as exc:
            names = ", ".join(sorted(arguments)) or "none"
            if isinstance(exc, KeyError) and exc.args and exc.args[0] not in arguments:
                why = f"refers to {exc}, which is not among the task's arguments ({names})"
            else:  # a field whose value does not fit it (``{n:d}`` of a str, ``{n[0]}``, ...)
                problem = f"{type(exc).__name__}: {exc}"
                why = f"cannot be filled from the task's arguments ({names}): {problem}"
            raise KeyDerivationError(
                f"lock_key template {source!r} of task {task_name!r} {why}"
            ) from exc
        return safe_key(prefix + raw)

    def _arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The task's arguments by parameter name, defaults applied (``*args`` and ``**kwargs``
        under their own names); the raw call when there is no signature (a C function)."""
        signature, named = self._signature, self._named
        if signature is None:
            return {"args": tuple(args), "kwargs": dict(kwargs)}
        if named is not None and (fast := named.bind(args, kwargs)) is not None:
            return fast
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise KeyDerivationError(
                f"cannot build the lock key of task {self.task_name!r}: its arguments do not "
                f"match its signature {signature} ({exc})"
            ) from exc
        bound.apply_defaults()
        return dict(bound.arguments)
