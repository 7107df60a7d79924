"""Both backends offer every member of the loop's protocol (``cluster.loop.protocol.Backend``):
the loop calls them without probing (no ``hasattr``), so a member one backend lacks must fail
here, before a run reaches it."""
import ast
import inspect

import pytest

from cluster.local import LocalBackend
from cluster.loop.protocol import Backend
from cluster.ray_wing.backend import RayBackend


def protocol_members() -> dict:
    """``{name: "method" | "attribute"}`` of the protocol, read from its class body (a read-only
    property is an attribute: a backend may set it in ``__init__``, as a class value or a property)."""
    members = {name: "attribute" for name in getattr(Backend, "__annotations__", {})}
    members.update({name: "attribute" for name, value in vars(Backend).items() if isinstance(value, property)})
    members.update({name: "method" for name, value in vars(Backend).items()
                    if inspect.isfunction(value) and not name.startswith("_")})
    return members


def init_attributes(cls) -> set:
    """Names ``cls.__init__`` (or its bases') assigns as ``self.<name>``."""
    out = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if not inspect.isfunction(init):  # object's, or none of its own
            continue
        for node in ast.walk(ast.parse(inspect.getsource(init).lstrip())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and isinstance(node.ctx, ast.Store):
                out.add(node.attr)
    return out


MEMBERS = protocol_members()


@pytest.mark.parametrize("cls", [LocalBackend, RayBackend], ids=["local", "ray"])
@pytest.mark.parametrize("name", sorted(MEMBERS))
def test_each_backend_offers_each_member(cls, name):
    if MEMBERS[name] == "method":
        assert callable(getattr(cls, name, None)), f"{cls.__name__} has no method {name}"
    else:
        assert hasattr(cls, name) or name in init_attributes(cls), f"{cls.__name__} has no attribute {name}"


def test_the_protocol_is_read_whole():
    assert {"train_step", "sync", "prepare_recovery", "fault_metrics", "scale_generators"} <= set(MEMBERS)
    assert {"can_scale_generators", "pad_token_id", "restarts", "remote"} <= set(MEMBERS)
    assert MEMBERS["sync"] == "method" and MEMBERS["restarts"] == "attribute"
