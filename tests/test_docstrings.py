"""The public API's docstrings document their arguments and stay short enough to skim.

In scope: every name in the public ``__all__`` lists (the package and its front ends), and for
a class every public method and property the package defines (its own or from one of its own
base classes). An override that keeps the framework's docstring (it has none of its own) is
out of scope: that text is the framework's. For each docstring:

- a function, method or constructor with parameters (besides ``self``/``cls``, ``*args``,
  ``**kwargs`` and private ``_name`` ones) has a Google-style ``Args:`` section naming each of them; a constructor's
  section sits in the class docstring or in ``__init__``'s;
- no sentence is longer than 45 words, and over all of them the median is at most 14.

Sentences are split on ". " and ".\\n", within paragraphs, list items and ``Args:`` entries;
code blocks and doctest examples are left out.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import re
import statistics
from collections.abc import Callable, Iterator

import pytest

FRONT_ENDS = {
    "ds_strategy": None,
    "ds_strategy.hf": "transformers",
    "ds_strategy.accelerate": "accelerate",
    "ds_strategy.lightning": "lightning",
    "ds_strategy.fabric": "lightning",
}

# Their docstrings are checked by test_engine_docstrings_document_their_arguments, apart.
ENGINE_FILES = ("ds_strategy/core/engine.py", "ds_strategy/core/pipeline/engine.py")

# A dataclass whose fields are the config keys: the configuration reference documents each.
FIELDS_DOCUMENTED_ELSEWHERE = {"ZeroConfig"}

MAX_WORDS = 45
MAX_MEDIAN = 14

SECTION = re.compile(
    r"^(Args|Arguments|Returns|Yields|Raises|Examples?|Notes?|Attributes|Warnings?|See Also):\s*$"
)
ENTRY = re.compile(r"^\s+\*{0,2}(\w+)(?: \([^)]*\))?:(?:\s|$)")
ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s")


@dataclasses.dataclass(frozen=True)
class Doc:
    """One docstring in scope, and the parameters its ``Args:`` section must name."""

    module: str  # the public module that exports it
    where: str  # its public name
    text: str  # the docstring whose sentences count
    params: tuple[str, ...] = ()
    args_text: str = ""  # where the Args: section is looked for, when not in ``text``
    headers: tuple[str, ...] = ("Args:",)  # a dataclass may list its fields as Attributes:
    source: str = ""  # the file that defines it


def _installed(module: str) -> bool:
    framework = FRONT_ENDS[module]
    return framework is None or importlib.util.find_spec(framework) is not None


def _source_file(obj: object) -> str:
    try:
        path = inspect.getsourcefile(inspect.unwrap(obj))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""
    return (path or "").replace("\\", "/")


def _params(fn: Callable[..., object], bound: bool) -> tuple[str, ...]:
    """The parameters a caller passes by name or position, ``self``/``cls`` left out."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ()
    params = list(sig.parameters.values())
    if bound and params:
        params = params[1:]
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return tuple(p.name for p in params if p.kind not in skip and not p.name.startswith("_"))


def _members(cls: type) -> Iterator[tuple[str, Callable[..., object], tuple[str, ...]]]:
    """(name, function, parameters) of each public member the package defines for ``cls``."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if not klass.__module__.startswith("ds_strategy"):
                continue
            if isinstance(value, property) and value.fget is not None:
                yield name, value.fget, ()
            elif isinstance(value, staticmethod):
                yield name, value.__func__, _params(value.__func__, False)
            elif isinstance(value, classmethod):
                yield name, value.__func__, _params(value.__func__, True)
            elif inspect.isfunction(value):
                yield name, value, _params(value, True)


def _class_docs(module: str, where: str, cls: type) -> Iterator[Doc]:
    """The class docstring (which, or ``__init__``'s, documents the constructor) and members'."""
    source = _source_file(cls)
    init = next((vars(k)["__init__"] for k in cls.__mro__ if "__init__" in vars(k)), None)
    if init is None or not getattr(init, "__module__", "").startswith("ds_strategy"):
        init = None  # a framework's constructor, documented there
    params: tuple[str, ...] = ()
    if init is not None and cls.__name__ not in FIELDS_DOCUMENTED_ELSEWHERE:
        params = _params(init, True)
    init_doc = inspect.cleandoc(init.__doc__ or "") if init is not None else ""
    text = inspect.getdoc(cls) or ""
    headers = ("Args:", "Attributes:") if dataclasses.is_dataclass(cls) else ("Args:",)
    yield Doc(module, where, text, params, f"{text}\n\n{init_doc}", headers, source)
    if init_doc and not dataclasses.is_dataclass(cls):
        yield Doc(module, f"{where}.__init__", init_doc, source=source)
    for attr, fn, fn_params in _members(cls):
        doc = inspect.cleandoc(getattr(fn, "__doc__", None) or "")
        if doc or not _framework_documents(cls, attr):
            yield Doc(module, f"{where}.{attr}", doc, fn_params, source=_source_file(fn))


def _framework_documents(cls: type, name: str) -> bool:
    """A framework's base class of ``cls`` documents the member ``name`` overrides."""
    for base in cls.__mro__[1:]:
        value = vars(base).get(name)
        if value is None or base.__module__.startswith("ds_strategy"):
            continue
        fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        if (getattr(fn, "__doc__", None) or "").strip():
            return True
    return False


def _docs() -> Iterator[Doc]:
    for module_name in FRONT_ENDS:
        if not _installed(module_name):
            continue
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            where = f"{module_name}.{name}"
            if inspect.isclass(obj):
                yield from _class_docs(module_name, where, obj)
            elif inspect.isfunction(obj):
                doc = inspect.getdoc(obj) or ""
                yield Doc(module_name, where, doc, _params(obj, False), source=_source_file(obj))


def _in_engine_files(doc: Doc) -> bool:
    return doc.source.endswith(ENGINE_FILES)


def _args_named(text: str, headers: tuple[str, ...] = ("Args:",)) -> set[str] | None:
    """The names the ``Args:`` sections list, or None when there is no such section."""
    lines = text.splitlines()
    names: set[str] | None = None
    for i, line in enumerate(lines):
        if line.strip() not in headers:
            continue
        indent = len(line) - len(line.lstrip())
        names = names or set()
        for entry in lines[i + 1 :]:
            if entry.strip() and len(entry) - len(entry.lstrip()) <= indent:
                break
            match = ENTRY.match(entry[indent:])
            if match and len(entry) - len(entry.lstrip()) == indent + 4:
                names.add(match.group(1))
    return names


def _prose(text: str) -> list[str]:
    """The docstring's paragraphs, list items and section entries; code and doctests left out."""
    chunks: list[list[str]] = [[]]
    fenced = doctest = False
    literal: int | None = None  # the indent of a line ending in "::" (a literal block follows)
    section: int | None = None  # the indent of the current section's header
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("```"):
            fenced = not fenced
            chunks.append([])
            continue
        if fenced:
            continue
        doctest = stripped.startswith(">>>") or (doctest and bool(stripped))
        if doctest:
            chunks.append([])
            continue
        if literal is not None:
            if not stripped or indent > literal:
                continue
            literal = None
        if not stripped:
            chunks.append([])
            continue
        if section is not None and indent <= section:
            section = None
        if SECTION.match(stripped):
            section = indent
            chunks.append([])
            continue
        entry = ENTRY.match(line) if section is not None and indent == section + 4 else None
        if entry:
            chunks.append([])
            line = line[entry.end() :]
        elif ITEM.match(line):
            chunks.append([])
            line = ITEM.sub("", line, count=1)
        chunks[-1].append(line.strip())
        if stripped.endswith("::"):
            literal = indent
            chunks.append([])
    return [" ".join(c) for c in chunks if c]


def _sentences(text: str) -> list[str]:
    out = []
    for chunk in _prose(text):
        out += [s.strip().rstrip(".") for s in re.split(r"\.\s+", chunk) if s.strip(" .")]
    return out


def _words(sentence: str) -> int:
    return len(sentence.split())


def _problems(docs: list[Doc]) -> list[str]:
    problems = []
    for doc in docs:
        if not doc.text:
            problems.append(f"{doc.where}: no docstring")
            continue
        if doc.params:
            named = _args_named(doc.args_text or doc.text, doc.headers)
            if named is None:
                problems.append(f"{doc.where}: no Args: section for {list(doc.params)}")
            elif missing := [p for p in doc.params if p not in named]:
                problems.append(f"{doc.where}: Args: does not name {missing}")
        for sentence in _sentences(doc.text):
            if _words(sentence) > MAX_WORDS:
                problems.append(f"{doc.where}: {_words(sentence)} words: {sentence[:80]}...")
    return problems


def _median(docs: list[Doc]) -> float:
    return statistics.median(_words(s) for doc in docs for s in _sentences(doc.text))


@functools.cache
def _all_docs() -> tuple[Doc, ...]:
    """Every docstring in scope (imported on first use, not when tests are collected)."""
    return tuple(_docs())


def test_the_sentence_splitter_leaves_code_out_and_splits_entries() -> None:
    text = inspect.cleandoc(
        """One line. Two words here.

        Args:
            model: the model. It may live
                on the meta device
            config: a dict

        >>> engine = initialize(model)  # not a sentence. at all
        >>> engine.stage
        1

        - an item
        - another. Two

        Run it::

            torchrun train.py. --flag
        """
    )
    assert _sentences(text) == [
        "One line",
        "Two words here",
        "the model",
        "It may live on the meta device",
        "a dict",
        "an item",
        "another",
        "Two",
        "Run it::",
    ]
    assert _args_named(text) == {"model", "config"}
    assert _args_named("Summary.") is None


@pytest.mark.parametrize("module", list(FRONT_ENDS))
def test_public_docstrings_name_their_arguments_and_keep_sentences_short(module: str) -> None:
    if not _installed(module):
        pytest.skip(f"{module} needs {FRONT_ENDS[module]}, which is not installed")
    docs = [d for d in _all_docs() if d.module == module and not _in_engine_files(d)]
    assert docs, f"nothing public found in {module}"
    problems = _problems(docs)
    assert not problems, "\n".join(problems)


def test_the_median_sentence_is_short() -> None:
    """Over every public docstring of the installed front ends (the engines' apart)."""
    docs = [d for d in _all_docs() if not _in_engine_files(d)]
    assert len(docs) > 30, [d.where for d in docs]
    median = _median(docs)
    assert median <= MAX_MEDIAN, f"median sentence length {median} words"


def test_engine_docstrings_document_their_arguments() -> None:
    docs = [d for d in _all_docs() if _in_engine_files(d)]
    assert len(docs) > 40, [d.where for d in docs]
    problems = _problems(docs)
    median = _median(docs)
    assert not problems, "\n".join(problems)
    assert median <= MAX_MEDIAN, f"median sentence length {median} words"
