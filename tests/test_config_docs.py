"""Every field of every typed config — each registered schema (every typed config group: algo, data,
model, pipeline) and every dataclass nested in one — is documented where it is defined (a docstring
right below it)."""

import ast
import dataclasses
import inspect

import pytest

from lit_rlhf.launch.schemas import SCHEMAS, schema_class


def documented_fields(cls: type) -> set[str]:
    """Fields followed by a string literal in the class bodies of ``cls`` and its bases."""
    out = set()
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for node, nxt in zip(body, body[1:]):
            documented = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
            text = nxt.value.value if documented else None
            if isinstance(node, ast.AnnAssign) and isinstance(text, str) and text.strip():
                out.add(node.target.id)
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_config_field_has_a_docstring(name):
    cls = schema_class(name)
    missing = sorted({f.name for f in dataclasses.fields(cls)} - documented_fields(cls))
    assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def _nested_configs() -> dict[str, type]:
    """Every dataclass a registered schema reaches through its fields' types (generation settings,
    the vLLM engine, LoRA, the tiny model, the task's language, ...), by qualified name."""
    import typing

    found: dict[str, type] = {}
    todo = [schema_class(name) for name in SCHEMAS]
    while todo:
        cls = todo.pop()
        for hint in typing.get_type_hints(cls).values():
            stack = [hint]
            while stack:
                t = stack.pop()
                stack += typing.get_args(t)
                if dataclasses.is_dataclass(t) and isinstance(t, type):
                    key = f"{t.__module__}:{t.__qualname__}"
                    if key not in found:
                        found[key] = t
                        todo.append(t)
    return found


NESTED = _nested_configs()


def test_the_walk_reaches_the_nested_configs():
    """The walk below is not vacuous: it finds the nested configs a reader meets in lit_rlhf/conf/."""
    assert {
        "lit_rlhf.rollout.config:GenerationConfig",
        "lit_rlhf.rollout.config:VLLMConfig",
        "lit_rlhf.models.spec:TinyLlamaConfig",
        "lit_rlhf.models.spec:LoraSpec",
        "lit_rlhf.data.synthetic:LanguageConfig",
    } <= set(NESTED), sorted(NESTED)


@pytest.mark.parametrize("path", sorted(NESTED))
def test_nested_config_fields_have_docstrings(path):
    cls = NESTED[path]
    missing = sorted({f.name for f in dataclasses.fields(cls)} - documented_fields(cls))
    assert not missing, f"{path} fields without a docstring: {missing}"
