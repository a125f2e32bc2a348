import random
from collections import Counter
from dataclasses import dataclass

import pytest

from inferd.gateway.config import RoutingConfig
from inferd.gateway.routing import Router, prefix_key, rendezvous


@dataclass
class R:
    id: str
    load: int = 0


def replicas(n: int) -> list[R]:
    return [R(f"r{i}") for i in range(n)]


# prefix_key


def test_chat_messages_give_role_and_content_pieces_in_order():
    body = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]}

    assert prefix_key(body, 256) == "<system>Be terse.\n<user>Hi\n"


def test_chat_key_is_cut_to_prefix_chars():
    body = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]}

    assert prefix_key(body, 10) == "<system>Be"
    assert prefix_key(body, 20) == "<system>Be terse.\n<u"


def test_shared_system_prompt_gives_same_key_within_prefix_chars():
    system = {"role": "system", "content": "S" * 300}
    a = {"messages": [system, {"role": "user", "content": "What is 2+2?"}]}
    b = {"messages": [system, {"role": "user", "content": "Name a colour."}]}

    assert prefix_key(a, 256) == prefix_key(b, 256) == "<system>" + "S" * 248
    assert prefix_key(a, 4096) != prefix_key(b, 4096)


def test_content_parts_count_their_text():
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello "},
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}},
        {"type": "text", "text": "world"},
    ]}]}

    assert prefix_key(body, 256) == "<user>Hello world\n"


def test_completion_prompt_string():
    assert prefix_key({"prompt": "Once upon a time"}, 256) == "Once upon a time"
    assert prefix_key({"prompt": "Once upon a time"}, 4) == "Once"


def test_completion_prompt_list_first_one_decides():
    assert prefix_key({"prompt": ["first prompt", "second prompt"]}, 256) == "first prompt"


def test_completion_prompt_token_ids():
    assert prefix_key({"prompt": [1, 22, 333]}, 256) == "1 22 333"
    assert prefix_key({"prompt": [[1, 2], [3]]}, 256) == "1 2"


def test_body_without_prompt_or_messages_has_no_key():
    assert prefix_key({"input": "embed me"}, 256) is None


def test_empty_prompt_has_no_key():
    assert prefix_key({"prompt": ""}, 256) is None
    assert prefix_key({"messages": []}, 256) is None


# rendezvous


def test_rendezvous_is_deterministic_for_a_key():
    pool = replicas(3)

    winners = {rendezvous("some prefix", pool).id for _ in range(10)}

    assert len(winners) == 1
    assert rendezvous("some prefix", list(reversed(pool))).id == winners.pop()


def test_removing_a_replica_moves_only_its_keys():
    three = replicas(3)
    two = three[:2]
    keys = [f"key-{i}" for i in range(1000)]

    before = {k: rendezvous(k, three).id for k in keys}
    after = {k: rendezvous(k, two).id for k in keys}

    kept = [k for k in keys if before[k] != "r2"]
    assert all(after[k] == before[k] for k in kept)
    assert 0 < len(kept) < 1000


def test_rendezvous_spreads_keys_evenly():
    rng = random.Random(0)
    keys = [f"{rng.getrandbits(64):x}" for _ in range(3000)]

    wins = Counter(rendezvous(k, replicas(3)).id for k in keys)

    assert sorted(wins) == ["r0", "r1", "r2"]
    assert all(0.25 * 3000 <= n <= 0.42 * 3000 for n in wins.values())


# Router.choose


def router(policy: str = "prefix_affinity", factor: float = 1.5, margin: int = 2) -> Router:
    return Router(RoutingConfig(policy=policy, overload_factor=factor, overload_margin=margin))


def affine_and_rest(key: str, pool: list[R]) -> tuple[R, list[R]]:
    affine = rendezvous(key, pool)
    return affine, [r for r in pool if r is not affine]


def test_equal_loads_go_to_the_affine_replica():
    pool = replicas(3)
    affine, _ = affine_and_rest("k", pool)

    assert router().choose(pool, "k") == (affine, "affinity")


def test_overloaded_affine_replica_yields_to_the_least_loaded():
    pool = replicas(3)
    affine, (least, other) = affine_and_rest("k", pool)
    affine.load, least.load, other.load = 3, 0, 5

    assert router().choose(pool, "k") == (least, "overload")


def test_affine_within_margin_stays_affine():
    pool = replicas(3)
    affine, (least, other) = affine_and_rest("k", pool)
    affine.load, least.load, other.load = 2, 0, 5

    assert router().choose(pool, "k") == (affine, "affinity")


def test_affine_within_factor_stays_affine():
    pool = replicas(3)
    affine, (least, other) = affine_and_rest("k", pool)
    affine.load, least.load, other.load = 10, 8, 9

    assert router().choose(pool, "k") == (affine, "affinity")


def test_affine_above_factor_and_margin_is_overloaded():
    pool = replicas(3)
    affine, (least, other) = affine_and_rest("k", pool)
    affine.load, least.load, other.load = 13, 8, 9

    assert router().choose(pool, "k") == (least, "overload")


def test_no_key_goes_to_the_least_loaded():
    pool = replicas(3)
    pool[0].load, pool[1].load, pool[2].load = 4, 1, 2

    assert router().choose(pool, None) == (pool[1], "least_loaded")


def test_least_loaded_ties_rotate():
    pool = replicas(3)
    r = router()

    chosen = [r.choose(pool, None)[0].id for _ in range(4)]

    assert chosen == ["r0", "r1", "r2", "r0"]


def test_least_loaded_policy_ignores_the_key():
    pool = replicas(3)
    affine, (least, other) = affine_and_rest("k", pool)
    affine.load, least.load, other.load = 1, 0, 5

    assert router("least_loaded").choose(pool, "k") == (least, "least_loaded")


def test_round_robin_cycles_in_order():
    pool = replicas(3)
    pool[0].load = 100
    r = router("round_robin")

    chosen = [r.choose(pool, "k") for _ in range(4)]

    assert chosen == [(pool[0], "round_robin"), (pool[1], "round_robin"), (pool[2], "round_robin"),
                      (pool[0], "round_robin")]


@pytest.mark.parametrize("policy", ["prefix_affinity", "least_loaded", "round_robin"])
def test_no_replicas_is_an_error(policy):
    with pytest.raises(ValueError, match="^replicas must not be empty$"):
        router(policy).choose([], "k")
