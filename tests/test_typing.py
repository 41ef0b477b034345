"""The package ships py.typed, so type checkers take its hints as complete: every public
function and method (fitcache.__all__, and the public methods of its classes) has them.
scripts/test.sh also runs mypy over the package, which checks that the hints hold."""

import inspect

import fitcache


# Dunder methods users call, directly or through a statement.
PUBLIC_DUNDERS = ("__init__", "__getitem__", "__getitems__", "__len__", "__enter__", "__exit__")


def public_callables():
    for name in fitcache.__all__:
        obj = getattr(fitcache, name)
        if inspect.isclass(obj):
            if issubclass(obj, BaseException):
                continue  # OSError's constructor and methods
            for attr, member in vars(obj).items():
                if inspect.isfunction(member) and (not attr.startswith("_") or attr in PUBLIC_DUNDERS):
                    yield f"{name}.{attr}", member
        elif callable(obj):
            yield name, obj


def test_the_public_api_has_type_hints():
    missing = []
    for name, fn in public_callables():
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
        if sig.return_annotation is inspect.Signature.empty or any(
                p.annotation is inspect.Parameter.empty for p in params):
            missing.append(name)
    assert not missing, f"public functions without complete type hints: {missing}"
