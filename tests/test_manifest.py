"""Manifests: parsing with line-numbered errors, seeded shuffles equal to PyTorch's, rank partitions."""

from __future__ import annotations

import math

import pytest

from epochfs.prefetch.manifest import ManifestError, epoch_order, parse, partition, permutation, shuffled

# torch.randperm(20, generator=torch.Generator().manual_seed(S)).tolist() with torch 2.13.0 (CPU)
TORCH_RANDPERM_20 = {
    2024: [12, 4, 0, 2, 15, 10, 5, 7, 13, 9, 17, 3, 1, 19, 14, 18, 6, 8, 16, 11],
    10: [17, 0, 8, 7, 4, 10, 1, 13, 9, 3, 16, 2, 11, 6, 5, 18, 14, 19, 15, 12],
}


def test_permutation_matches_torch_randperm_known_answers():
    for seed, expected in TORCH_RANDPERM_20.items():
        assert permutation(20, seed) == expected


def test_shuffled_is_seed_plus_epoch():
    items = [f"p{i}" for i in range(20)]
    assert shuffled(items, 7, 3) == [items[i] for i in TORCH_RANDPERM_20[10]]
    assert shuffled(items, 7, 3) != shuffled(items, 7, 4)
    assert sorted(shuffled(items, 1, 0)) == sorted(items)


def test_against_the_real_distributed_sampler_if_torch_is_installed():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler

    class Sized:
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

    for n in (1, 3, 10, 13, 101):
        for world in (1, 2, 4, 8):
            for epoch in (0, 5):
                for rank in range(world):
                    for drop_last in (False, True):
                        sampler = DistributedSampler(Sized(n), num_replicas=world, rank=rank, shuffle=True,
                                                     seed=11, drop_last=drop_last)
                        sampler.set_epoch(epoch)
                        assert list(sampler) == epoch_order(list(range(n)), seed=11, epoch=epoch, rank=rank,
                                                            world_size=world, drop_last=drop_last)
    assert torch.randperm(20, generator=torch.Generator().manual_seed(2024)).tolist() == permutation(20, 2024)


@pytest.mark.parametrize("n,world", [(10, 3), (8, 4), (5, 8), (1, 3), (100, 7)])
def test_rank_partitions_cover_the_manifest_with_documented_padding(n, world):
    items = list(range(n))
    shares = [partition(items, r, world) for r in range(world)]
    per_rank = math.ceil(n / world)
    assert all(len(s) == per_rank for s in shares)
    # interleaving the shares gives back the padded global order: items, then wrapped from the start
    padded = [shares[i % world][i // world] for i in range(per_rank * world)]
    assert padded == (items * (per_rank * world // n + 1))[:per_rank * world]
    assert set().union(*map(set, shares)) == set(items)
    # without the padding, no entry is read by two ranks
    owners: dict[int, int] = {}
    for pos, item in enumerate(padded[:n]):
        assert item not in owners
        owners[item] = pos % world


def test_partition_rejects_bad_ranks():
    with pytest.raises(ValueError):
        partition([1, 2], 2, 2)
    with pytest.raises(ValueError):
        partition([1, 2], 0, 0)


def test_parse_plain_and_json_lines():
    text = "# epoch 3\n\na/b.jpg\n/c/d.jpg\n{\"path\": \"e.bin\", \"size\": 12, \"etag\": \"x\"}\n"
    entries = parse(text)
    assert [(e.line, e.path, e.size) for e in entries] == [(3, "a/b.jpg", None), (4, "/c/d.jpg", None),
                                                            (5, "e.bin", 12)]


@pytest.mark.parametrize("text,line,what", [
    ("ok\n{\"path\": 3}\n", 2, "path"),
    ("ok\nfine\n{broken\n", 3, "invalid JSON"),
    ("a/../b\n", 1, "not a clean path"),
    ("x\n{\"path\": \"y\", \"size\": -1}\n", 2, "size"),
    ("# only comments\n\n", None, "no paths"),
])
def test_parse_errors_name_the_line(text, line, what):
    with pytest.raises(ManifestError) as info:
        parse(text, source="epoch3.txt")
    message = str(info.value)
    assert what in message
    if line is not None:
        assert f"epoch3.txt:{line}:" in message


def test_paths_absolute_under_the_mount_point_or_relative_to_its_root():
    from epochfs.prefetch.manifest import mount_relative

    assert mount_relative("/mnt/data", "/mnt/data/train/a.jpg") == "train/a.jpg"
    assert mount_relative("/mnt/data/", "train/a.jpg") == "train/a.jpg"
    assert mount_relative("/mnt/data", "/mnt/data") == ""
    for outside in ("/mnt/other/a.jpg", "/etc/passwd", "/mnt/data/../x"):
        with pytest.raises(ManifestError, match="not under the mount point"):
            mount_relative("/mnt/data", outside)


@pytest.mark.parametrize("n,world", [(10, 3), (8, 4), (5, 8), (13, 4)])
def test_drop_last_partitions_cut_the_tail_instead_of_padding(n, world):
    items = list(range(n))
    shares = [partition(items, r, world, drop_last=True) for r in range(world)]
    assert all(len(s) == n // world for s in shares)
    assert sorted(x for s in shares for x in s) == items[: (n // world) * world]
