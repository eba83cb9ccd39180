"""The identity memo behind admission's spec caches and the boundary's per-config values."""

from vllm_nnsight_plugin.engine.memo import IdentityMemo


def test_a_value_is_computed_once_per_object_and_per_extra_key():
    memo: IdentityMemo[int] = IdentityMemo()
    calls = []
    a, b = {"ops": []}, {"ops": []}  # equal, not the same object

    def compute(tag):
        calls.append(tag)
        return len(calls)

    assert memo.get(a, lambda: compute("a")) == 1
    assert memo.get(a, lambda: compute("a")) == 1
    assert memo.get(b, lambda: compute("b")) == 2  # (equal dicts: still a new object)
    assert memo.get(a, lambda: compute("a8"), extra=8) == 3
    assert memo.get(a, lambda: compute("a8"), extra=8) == 3
    assert calls == ["a", "b", "a8"]


def test_an_object_not_kept_is_computed_each_time_and_not_held():
    memo: IdentityMemo[int] = IdentityMemo()
    big = {"ops": []}
    assert memo.get(big, lambda: 1, keep=False) == 1
    assert memo.get(big, lambda: 2, keep=False) == 2
    assert len(memo) == 0


def test_a_full_memo_empties_before_it_keeps_more():
    memo: IdentityMemo[int] = IdentityMemo(limit=3)
    held = [object() for _ in range(4)]
    for i, obj in enumerate(held):
        memo.get(obj, lambda i=i: i)
    assert len(memo) == 1  # (the fourth found it full)
    assert memo.get(held[3], lambda: -1) == 3
    assert memo.get(held[0], lambda: -1) == -1
