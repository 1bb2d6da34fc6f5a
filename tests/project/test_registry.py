"""Registries take a name once: a second registration under a taken name is refused with
the kind, the name and both definitions, and the first one stays. A tag lists the names
registered with it, the selections defaults read instead of lists beside the registry."""

import pytest

import attn_patterns
from attn_patterns.registry import Registry
from sparse_ft import methods


def test_a_taken_name_is_refused_naming_kind_name_and_both_definitions():
    table = Registry("widget", object)

    @table.register
    def spoke(length: int = 1) -> object:
        return ("first", length)

    def another() -> object:
        return "second"

    with pytest.raises(ValueError) as err:
        table.register(another, name="spoke")
    message = str(err.value)
    assert message.startswith("widget name 'spoke' is already taken by ")
    assert f"{__name__}.test_a_taken_name_is_refused_naming_kind_name_and_both_definitions.<locals>.spoke" in message
    assert f"{__name__}.test_a_taken_name_is_refused_naming_kind_name_and_both_definitions.<locals>.another" in message
    assert table.get("spoke", length=2) == ("first", 2)  # the first stays
    table.remove("spoke")
    table.register(another, name="spoke")  # a removed name is free again
    assert table.get("spoke") == "second"


def test_the_shipped_registries_refuse_their_own_names():
    class Shadow(attn_patterns.Pattern):
        name = "s2"

    with pytest.raises(ValueError, match=r"pattern name 's2' is already taken by attn_patterns\.patterns\.S2; .*Shadow"):
        attn_patterns.register(Shadow)

    class Impostor(methods.Method):
        name = "dca"

    with pytest.raises(ValueError, match=r"method name 'dca' is already taken by sparse_ft\.methods\.dca\.DualChunk; .*Impostor"):
        methods.register(Impostor)
    assert type(methods.get("dca")).__name__ == "DualChunk" and repr(attn_patterns.get("s2")).startswith("s2(")


def test_a_tag_lists_its_names_in_registration_order_and_an_unknown_tag_is_refused():
    table = Registry("widget", object)
    table.register(lambda: "a", name="a", tags=("paper",))
    table.register(lambda count: "b", name="b")
    table.register(lambda: "c", name="c", tags=("paper", "fast"))
    assert table.names(tag="paper") == ["a", "c"] and table.names() == ["a", "b", "c"]
    assert table.required("b") == ["count"] and table.required("a") == []
    with pytest.raises(ValueError, match=r"^widget tag='papers' is unknown; allowed: fast, paper$"):
        table.names(tag="papers")
    table.remove("c")
    assert table.names(tag="paper") == ["a"]
    # the selection the experiment trains and `bench train` times: SCCA's Table 2
    assert attn_patterns.PATTERNS.names(tag="scca_table2") == ["s2", "scca_fixed", "scca_flow", "longmixed"]
