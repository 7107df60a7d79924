"""A hook with the wrong parameters is named before any work starts, with its documented
signature: a reference update given to the local backend or to a Ray cluster (before Ray
starts), and any other hook ``check_arity`` checks."""
import pytest

from cluster.local import LocalBackend
from cluster.ray_wing.config import ClusterConfig
from cluster.ray_wing.roles import build_rl_cluster
from primitives.fixtures.tasks import arithmetic_reward
from primitives.hooks import check_arity
from rl_actors.trainer import TrainerConfig

REF_UPDATE = "the documented signature is ref_update_fn(ref_state, policy_weights, step, kl) -> ref_state"


def seed_style_update(ref, policy):
    """The seeds' reference update: no step, no kl."""
    return ref


def test_a_two_parameter_reference_update_is_named_by_the_local_backend(tmp_path):
    """Refused before the model loads (the path is not even a model)."""
    with pytest.raises(ValueError) as e:
        LocalBackend(str(tmp_path / "no_model"), arithmetic_reward, with_reference=True,
                     ref_update_fn=seed_style_update)
    assert "ref_update_fn: tests.cluster.test_hook_signatures.seed_style_update(ref, policy) cannot be called with " \
           "4 argument(s)" in str(e.value)
    assert REF_UPDATE in str(e.value)


@pytest.mark.own_ray  # shuts the run's Ray down: the check must come before any Ray starts
def test_a_two_parameter_reference_update_is_named_before_ray_starts(tmp_path):
    import ray

    ray.shutdown()
    with pytest.raises(ValueError, match="ref_update_fn: .*<lambda>\\(ref, policy\\)") as e:
        build_rl_cluster(str(tmp_path / "no_model"), ClusterConfig(generators=1, trainers=1), TrainerConfig(),
                         arithmetic_reward, with_reference=True, ref_update_fn=lambda ref, policy: ref)
    assert REF_UPDATE in str(e.value)
    assert not ray.is_initialized()


def test_every_checked_hook_says_its_documented_signature():
    """The name after an algorithm's prefix finds the signature; a hook the table lacks keeps
    the plain message."""
    from primitives.hooks import HOOK_SIGNATURES

    with pytest.raises(ValueError, match=r"kl_fn: .* \(B, T\)$") as e:
        check_arity(lambda logp: logp, "algorithm 'grpo': kl_fn", 1, 2, 3)
    assert str(e.value).endswith(f"the documented signature is {HOOK_SIGNATURES['kl_fn']}")
    with pytest.raises(ValueError) as e:
        check_arity(lambda: 0, "my_hook", 1)
    assert "documented signature" not in str(e.value)
    check_arity(lambda ref, policy, step, kl=None: ref, "ref_update_fn", None, {}, 0, None)  # the kl module's form
