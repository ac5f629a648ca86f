"""Every field of every typed config is documented where it is defined (a docstring right below it)."""

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


@pytest.mark.parametrize(
    "path",
    [
        "lit_rlhf.rollout.generate:GenerationConfig",
        "lit_rlhf.rollout.config:VLLMConfig",
        "lit_rlhf.models.spec:TinyLlamaConfig",
        "lit_rlhf.models.spec:LoraSpec",
        "lit_rlhf.data.synthetic:TaskConfig",
        "lit_rlhf.data.synthetic:LanguageConfig",
    ],
)
def test_nested_config_fields_have_docstrings(path):
    import importlib

    module, name = path.split(":")
    cls = getattr(importlib.import_module(module), name)
    missing = sorted({f.name for f in dataclasses.fields(cls)} - documented_fields(cls))
    assert not missing, f"{name} fields without a docstring: {missing}"
