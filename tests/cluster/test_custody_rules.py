"""Where the driver thinks a result is (``cluster.ray_wing.custody``), without Ray. A result's
node reaches the driver in the raylet's own report, which can come after the result: on one
node, a snapshot part of 1.2 MB was once reported with no node and copied for nothing (a job on
kept actors then logged ``faults/kept_mb`` where the same job on new ones did not). An object with
no node yet is asked about again until it is placed; one that never is (its node was lost) is
given up on after the wait, and the copy names its maker."""
from cluster.ray_wing.custody import INLINE_BYTES, _stays, where_now

HERE, OTHER = "node-a", "node-b"


class Locator:
    """Ray's answers, one list per object: the n-th ask about it gets its n-th entry (the last from
    then on); each ask's objects are recorded."""

    def __init__(self, answers: dict):
        self.answers, self.asks = answers, []

    def __call__(self, refs: list) -> dict:
        self.asks.append(list(refs))
        out = {}
        for r in refs:
            n = sum(r in ask for ask in self.asks) - 1
            entry = self.answers[r][min(n, len(self.answers[r]) - 1)]
            if entry is not None:  # Ray leaves out an object whose lookup failed
                out[r] = entry
        return out


def entry(*nodes: str, size: int = 1_243_810, spilled: bool = False) -> dict:
    return {"node_ids": list(nodes), "object_size": size, "did_spill": spilled}


def test_an_object_with_no_node_yet_is_asked_about_until_it_is_placed():
    late = [entry(), entry(), entry(HERE)]  # placed on the third ask
    locate = Locator({"late": late, "here": [entry(HERE)], "small": [entry(size=INLINE_BYTES)],
                      "spilled": [entry(spilled=True)], "failed": [None, entry(OTHER)]})
    where = where_now(["late", "here", "small", "spilled", "failed"], locate, wait_s=5.0)
    assert locate.asks == [["late", "here", "small", "spilled", "failed"], ["late", "failed"], ["late"]]
    assert _stays(where["late"], HERE) and _stays(where["here"], HERE) and _stays(where["small"], HERE)
    assert not _stays(where["spilled"], HERE) and not _stays(where["failed"], HERE)  # copied: may be elsewhere
    assert not _stays(where["late"], OTHER)  # from another node's driver it is far


def test_an_object_never_placed_is_given_up_on_after_the_wait():
    locate = Locator({"lost": [entry()], "here": [entry(HERE)]})
    where = where_now(["lost", "here"], locate, wait_s=0.3)
    # pauses of 10, 20, 40, 80 ms fit in 0.3 s, the next (160) does not: at most 5 asks (fewer when
    # sleeps run long); the default wait (2 s) makes 12
    assert 2 <= len(locate.asks) <= 5
    assert all(ask == ["lost"] for ask in locate.asks[1:])
    assert not _stays(where["lost"], HERE)  # no node, too large to be inline: copied (and found lost there)
    assert where_now(["here"], Locator({"here": [entry(HERE)]}), wait_s=0.0) == {"here": entry(HERE)}
