"""Shards in object storage, read from a real S3 API on localhost (moto's server): every sample once per epoch for any
workers and ranks, exactly as the same shards on local disk; a mid-epoch resume continues exactly; transient faults
are retried and counted with nothing lost; a shard that stays unreachable is skipped by name."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from s3_server import FaultProxy, RangeServer, s3_environment, s3_server, upload

from naflexclip.checkpoints import storage as ckpt
from naflexclip.cli import main
from naflexclip.data import DataConfig, DataError, build_loader, remote
from naflexclip.data.dataset_export import export_synthetic
from naflexclip.data.samples import READ_NOTES

PATCH, CONTEXT = 8, 16
LOCAL_SPEC = "train-{00000..00003}.tar"
SAMPLES = 40


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory):
    """40 built-in scenes in 4 shards, on local disk and in an S3 bucket (with and without a sizes.json):
    and as Parquet in the Hub's layout: (endpoint, local folder, the local folder without sizes.json, the Parquet
    folder)."""
    local = tmp_path_factory.mktemp("shards")
    export_synthetic(str(local), count=SAMPLES, shard_size=10, image_format="png")
    unsized = tmp_path_factory.mktemp("unsized")
    for name in os.listdir(local):
        if name.endswith(".tar"):
            shutil.copy(local / name, unsized / name)
    tables = tmp_path_factory.mktemp("parquet")
    export_synthetic(str(tables), fmt="parquet", count=SAMPLES, shard_size=10, image_format="png")
    with s3_server() as endpoint:
        saved = {k: os.environ.get(k) for k in s3_environment(endpoint)}
        os.environ.update(s3_environment(endpoint))
        upload(str(local), "s3://data/sized")
        upload(str(unsized), "s3://data/unsized")
        upload(str(tables), "s3://data/parquet")
        try:
            yield endpoint, local, unsized, tables
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(autouse=True)
def fresh_filesystems() -> None:
    """Each test's endpoint (a fault proxy's or the server's) is read when its first request is made."""
    remote.forget_filesystems()
    yield
    remote.forget_filesystems()


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)


def config(spec: str, tmp_path: Path, **overrides) -> DataConfig:
    # fetch_chunk_size=0 where a test counts faults per sample read (chunks: one read per shard here)
    values = dict(train_data=spec, naflex_seq_lens=(16, 32), naflex_max_tokens_per_batch=128, workers=0, seed=3,
                  shard_index_dir=str(tmp_path / "index"))
    values.update(overrides)
    return DataConfig(**values)


def epoch_keys(cfg: DataConfig, world_size: int = 1) -> tuple[list[str], Counter]:
    """The sample keys (without their shard's folder) every rank trains in epoch 0, in order, and the skips."""
    keys: list[str] = []
    skips: Counter = Counter()
    for rank in range(world_size):
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=rank,
                              world_size=world_size)
        keys += [key.rpartition("/")[2] for batch in loader for key in batch["keys"]]
        skips.update(loader.skip_counts)
    return keys, skips


@pytest.mark.parametrize("folder", ["sized", "unsized"])
def test_remote_shards_train_every_sample_once_in_the_local_order(bucket, tmp_path: Path, folder: str) -> None:
    """With a sizes.json (counted at startup, each shard's index then read from the cache by the worker that reads
    it) and without (indexed at startup): every sample once, for any workers and ranks, in the order the same shards
    on local disk give."""
    source = bucket[1] if folder == "sized" else bucket[2]
    local_keys, _ = epoch_keys(config(str(source / LOCAL_SPEC), tmp_path / "local"), world_size=2)
    assert sorted(local_keys) == [f"train-0000{i // 10}.tar:train{i:08d}" for i in range(SAMPLES)]
    for workers, world_size in ((0, 1), (2, 2)):
        cfg = config(f"s3://data/{folder}/{LOCAL_SPEC}", tmp_path / f"{workers}", workers=workers)
        keys, skips = epoch_keys(cfg, world_size)
        if world_size == 2:
            assert keys == local_keys
        assert Counter(keys) == Counter(local_keys) and not skips


def test_remote_shards_that_sizes_json_under_counts_train_every_sample_and_are_named(bucket, tmp_path: Path) -> None:
    miscounted = tmp_path / "miscounted"
    miscounted.mkdir()
    for name in os.listdir(bucket[2]):
        shutil.copy(bucket[2] / name, miscounted / name)
    (miscounted / "sizes.json").write_text(json.dumps({f"train-0000{s}.tar": 4 if s == 2 else 10 for s in range(4)}))
    upload(str(miscounted), "s3://data/miscounted")
    keys, skips = epoch_keys(config(f"s3://data/miscounted/{LOCAL_SPEC}", tmp_path, workers=2), world_size=2)
    assert Counter(keys) == Counter(f"train-0000{i // 10}.tar:train{i:08d}" for i in range(SAMPLES))
    assert skips == {"shard_holds_more": 1}  # train-00002.tar: listed 4, holds 10, named once


def test_remote_parquet_and_a_mixture_with_remote_shards_read_as_local_files_do(bucket, tmp_path: Path) -> None:
    parquet = "train-{00000..00003}.parquet"
    local_keys, _ = epoch_keys(config(str(bucket[3] / parquet), tmp_path))
    remote_keys, skips = epoch_keys(config(f"s3://data/parquet/{parquet}", tmp_path, workers=2))
    assert remote_keys == local_keys and len(set(remote_keys)) == SAMPLES and not skips
    mixture = config(f"s3://data/sized/{LOCAL_SPEC}::s3://data/parquet/{parquet}", tmp_path,
                     train_data_upsampling_factors="1::0.5")
    keys, skips = epoch_keys(mixture)
    assert sum(".tar:" in k for k in keys) == SAMPLES and sum(".parquet:" in k for k in keys) == SAMPLES // 2
    assert len(set(keys)) == len(keys) and not skips


def _cut_and_resumed(tmp_path: Path, between: Callable[[], None] = lambda: None) -> tuple[Any, list, Any, list]:
    """An uninterrupted epoch of the sized remote shards, and the same epoch cut after 3 microbatches and resumed
    with 2 workers: (its loader, its microbatches' keys, the resumed loader, the keys before and after the cut)."""
    cfg = config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path)
    whole = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    expected = [batch["keys"] for batch in whole]
    first = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    head = []
    for batch in first:
        head.append(batch["keys"])
        if len(head) == 3:
            break
    state = first.state_dict()
    between()
    resumed = build_loader(config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path, workers=2), split="train",
                           patch_size=PATCH, context_length=CONTEXT)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"], state["position"])
    return whole, expected, resumed, head + [batch["keys"] for batch in resumed]


def test_a_remote_epoch_resumed_mid_way_continues_exactly(bucket, tmp_path: Path) -> None:
    _, expected, _, keys = _cut_and_resumed(tmp_path)
    assert keys == expected


@pytest.mark.parametrize("chunk", [0, 8])
def test_transient_faults_are_retried_and_counted_and_nothing_is_lost(bucket, tmp_path: Path, fast_retries,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      chunk: int) -> None:
    """Every third request fails (503 SlowDown, 500, a body cut half-way) up to 12 times: the epoch is the whole
    data, each retry is a `read_retry` note (`read_throttled` for SlowDown), read by sample or by chunk. Teeth:
    without retries the same faults lose samples."""
    endpoint = bucket[0]
    expected, _ = epoch_keys(config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path / "clean", fetch_chunk_size=chunk))
    for retries in (remote.RETRIES, 0):
        proxy = FaultProxy(endpoint, every=3, limit=12)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        remote.forget_filesystems()
        monkeypatch.setattr(remote, "RETRIES", retries)
        try:
            cfg = config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path / f"faulty{retries}", fetch_chunk_size=chunk)
            if retries:
                keys, skips = epoch_keys(cfg)
                assert keys == expected and proxy.failed >= (6 if chunk == 0 else 3)
                assert set(skips) <= {"read_retry", "read_throttled"}
                assert skips["read_retry"] + skips["read_throttled"] >= (4 if chunk == 0 else 1)
            else:
                try:
                    keys, skips = epoch_keys(cfg)
                    lost = Counter(keys) != Counter(expected) or bool(skips.keys() - {"read_retry"})
                except DataError:  # the shard listing failed
                    lost = True
                assert lost
        finally:
            proxy.close()


def test_retried_reads_are_reported_apart_from_skipped_samples(bucket, tmp_path: Path, fast_retries,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A read that succeeded on retry trained its sample: the epoch's line and the loader's summary say
    `skipped 0` and count the retries apart."""
    proxy = FaultProxy(bucket[0], every=3, limit=12)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    remote.forget_filesystems()
    try:
        loader = build_loader(config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path, fetch_chunk_size=0), split="train",
                              patch_size=PATCH, context_length=CONTEXT)
        with caplog.at_level("INFO", logger="naflexclip.data"):
            keys = [key for batch in loader for key in batch["keys"]]
    finally:
        proxy.close()
    retried, throttled = loader.skip_counts["read_retry"], loader.skip_counts["read_throttled"]
    assert len(set(keys)) == SAMPLES and retried >= 2 and throttled >= 2
    assert set(loader.skip_counts) == {"read_retry", "read_throttled"}
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data train epoch 1")]
    assert line.endswith(f"; skipped 0; {retried} reads retried; {throttled} reads throttled"), line
    assert loader.summary().endswith(f": no samples skipped; {retried} reads retried; {throttled} reads throttled")


def test_a_shard_that_stays_unreachable_is_skipped_by_name_with_its_samples(bucket, tmp_path: Path, fast_retries,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = bucket[0]
    monkeypatch.setattr(remote, "RETRIES", 2)
    proxy = FaultProxy(endpoint, every=10**9, limit=0, down="train-00002.tar")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    remote.forget_filesystems()
    try:
        loader = build_loader(config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path), split="train", patch_size=PATCH,
                              context_length=CONTEXT)
        keys = [key for batch in loader for key in batch["keys"]]
    finally:
        proxy.close()
    assert len(keys) == 30 and not any("train-00002" in k for k in keys)
    assert loader.skip_counts["unreachable_shard"] == 10  # sizes.json's count: the samples the shard held
    record = next(r for r in loader.skip_records if r["reason"] == "unreachable_shard")
    assert record["source"] == "s3://data/sized/train-00002.tar"
    assert "s3://data/sized/train-00002.tar" in record["detail"] and "after 3 attempts" in record["detail"]


def test_a_store_that_cannot_be_reached_stops_in_one_line(bucket, tmp_path: Path, fast_retries,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(remote, "RETRIES", 1)
    with FaultProxy(bucket[0], every=1, limit=10**9) as proxy:  # every request fails
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        remote.forget_filesystems()
        code = main(["train", "--model", "tiny", "--device", "cpu", "--workers", "0", "--logs", str(tmp_path),
                     "--train-data", f"s3://data/unsized/{LOCAL_SPEC}", "--shard-index-dir", str(tmp_path / "i")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("naflexclip train: error: ") and "s3://data/unsized/train-{00000..00003}.tar" in err[-1]


def _weights(run_dir: Path) -> str:
    latest = ckpt.find_latest(run_dir / "checkpoints")
    return hashlib.sha256((latest / ckpt.MODEL_FILE).read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_run_from_the_bucket_stopped_and_resumed_ends_on_the_uninterrupted_weights(bucket, tmp_path: Path) -> None:
    flags = ["--model", "tiny", "--device", "cpu", "--epochs", "1", "--warmup", "1", "--val-frequency", "0",
             "--no-plot", "--zero-shot-samples", "4", "--naflex-seq-lens", "16", "32",
             "--naflex-max-tokens-per-batch", "128", "--workers", "2", "--logs", str(tmp_path),
             "--train-data", f"s3://data/sized/{LOCAL_SPEC}", "--shard-index-dir", str(tmp_path / "index")]
    assert main(["train", *flags, "--name", "whole"]) == 0
    assert main(["train", *flags, "--name", "part", "--stop-after-steps", "2", "--save-every-n-steps", "1"]) == 0
    assert main(["train", *flags, "--name", "part", "--resume", "latest", "--workers", "0"]) == 0
    assert _weights(tmp_path / "part") == _weights(tmp_path / "whole")
    local = ["--train-data", str(bucket[1] / LOCAL_SPEC)]
    assert main(["train", *flags, *local, "--name", "local"]) == 0
    assert _weights(tmp_path / "local") == _weights(tmp_path / "whole")  # the bucket trains what local disk does


def _train_flags(tmp_path: Path, spec: str, workers: int = 0) -> list[str]:
    return ["--model", "tiny", "--device", "cpu", "--epochs", "1", "--warmup", "1", "--val-frequency", "0",
            "--no-plot", "--zero-shot-samples", "4", "--zeroshot-frequency", "0", "--naflex-seq-lens", "16", "32",
            "--naflex-max-tokens-per-batch", "128", "--workers", str(workers), "--logs", str(tmp_path),
            "--train-data", spec, "--shard-index-dir", str(tmp_path / "index")]


def test_retried_reads_are_counted_once_the_same_in_the_epoch_line_and_the_run_summary(
        bucket, tmp_path: Path, fast_retries, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """More retries than the console shows one by one: the epoch's line and the run's summary give one count, and
    the line after the shown ones speaks of notes, not of skipped samples (none was)."""
    with FaultProxy(bucket[0], every=2, limit=60) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        remote.forget_filesystems()
        assert main(["train", *_train_flags(tmp_path, f"s3://data/sized/{LOCAL_SPEC}"), "--fetch-chunk-size", "0",
                     "--name", "flaky"]) == 0
    out = capsys.readouterr()
    console = out.out + out.err
    epoch_line = next(line for line in console.splitlines() if "data train epoch 1 rank 0" in line)
    retried, throttled = (int(part.split()[0]) for part in epoch_line.split("; ")[-2:])
    assert retried + throttled > 20, epoch_line
    assert epoch_line.endswith(f"; skipped 0; {retried} reads retried; {throttled} reads throttled"), epoch_line
    assert (f"epoch 1: trained {SAMPLES} samples, skipped 0 bad; noted: read_retry={retried}, "
            f"read_throttled={throttled}") in console
    assert "more skipped" not in console and "more notes (train)" in console


def test_a_missing_credential_is_said_once_at_once_naming_how_to_provide_one(
        bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    remote.forget_filesystems()
    calls = Counter()
    sleep = remote.time.sleep
    monkeypatch.setattr(remote.time, "sleep", lambda s: (calls.update(["sleep"]), sleep(s)))
    code = main(["train", *_train_flags(tmp_path, f"s3://data/sized/{LOCAL_SPEC}"), "--name", "anon"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "read_retry" not in err and not calls
    last = err.strip().splitlines()[-1]
    assert "NoCredentialsError" in last and "attempts" not in last and "AWS_ACCESS_KEY_ID" in last, last


def _rewrite(url: str, with_bytes_of: Path) -> None:
    """Replace an object of the bucket with other content (another shard's: other samples, another size)."""
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).put_file(str(with_bytes_of), url)


@pytest.mark.parametrize("folder,chunk", [("sized", 0), ("unsized", 0), ("sized", 8)])
def test_a_shard_rewritten_mid_epoch_is_a_named_fault_never_data(bucket, tmp_path: Path, folder: str,
                                                                 chunk: int) -> None:
    """train-00002.tar is replaced by another shard's bytes after the epoch was planned and its first microbatch
    read: none of what it now holds trains, each of its samples read after it changed is `shard_changed` (by
    chunk: a chunk fetched before the change trains the bytes that were planned; one fetched after is refused)."""
    source = bucket[1] if folder == "sized" else bucket[2]
    prefix = f"s3://data/rewritten-{folder}-{chunk}"
    upload(str(source), prefix)
    loader = build_loader(config(f"{prefix}/{LOCAL_SPEC}", tmp_path, fetch_chunk_size=chunk,
                                 naflex_max_tokens_per_batch=128 if chunk == 0 else 32), split="train",
                          patch_size=PATCH, context_length=CONTEXT)
    batches = iter(loader)
    keys = list(next(batches)["keys"])
    _rewrite(f"{prefix}/train-00002.tar", source / "train-00000.tar")
    keys += [key for batch in batches for key in batch["keys"]]
    changed = [r for r in loader.skip_records if r["reason"] == "shard_changed"]
    assert set(loader.skip_counts) <= {"shard_changed"}, loader.skip_counts
    assert all(r["source"] == f"{prefix}/train-00002.tar" for r in changed)
    assert chunk or "changed since it was planned" in changed[0]["detail"]
    read_before = sum("train-00002.tar" in k for k in keys)
    assert read_before + len(changed) == 10 and len(keys) == SAMPLES - len(changed)
    assert all(int(k[-8:]) // 10 == int(k.split(".tar")[0][-1]) for k in keys)  # each key its own shard's


@pytest.mark.parametrize("folder", ["sized", "unsized"])
@pytest.mark.parametrize("chunk", [0, 8])
def test_a_resume_that_finds_a_shard_rewritten_since_the_checkpoint_says_so_and_never_trains_it(
        bucket, tmp_path: Path, folder: str, chunk: int, caplog: pytest.LogCaptureFixture) -> None:
    source = bucket[1] if folder == "sized" else bucket[2]
    prefix = f"s3://data/resume-rewritten-{folder}-{chunk}"
    upload(str(source), prefix)
    cfg = config(f"{prefix}/{LOCAL_SPEC}", tmp_path, fetch_chunk_size=chunk)
    first = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    head = []
    for batch in first:
        head += batch["keys"]
        if len(head) >= 8:
            break
    state = first.state_dict()
    _rewrite(f"{prefix}/train-00002.tar", source / "train-00000.tar")
    remote.forget_filesystems()  # a new process: nothing of the first one's listing is kept
    resumed = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        resumed.load_state_dict([state])
        resumed.set_epoch(state["epoch"], state["position"])
        rest = [key for batch in resumed for key in batch["keys"]]
    said = [r.getMessage() for r in caplog.records if "changed since the checkpoint" in r.getMessage()]
    assert len(said) == 1 and "1 shard changed since the checkpoint" in said[0]
    assert f"{prefix}/train-00002.tar" in said[0]
    assert all(int(k[-8:]) // 10 == int(k.split(".tar")[0][-1]) for k in head + rest)  # nothing of the new bytes
    assert resumed.skip_counts["shard_changed"] == 10 - sum("train-00002" in k for k in head)


def _start_fault(kind: str, url: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch) -> list:
    """Break the shard at `url` once the run's startup has pinned and indexed it, as its epoch starts reading:
    `outage` (every request for it fails, past the retries) or `deleted` (the object is gone). Returns the list the
    run's training loader is put in."""
    from naflexclip.data.map_loader import MapLoader

    dataloader, loaders = MapLoader._dataloader, []

    def break_then_read(self: MapLoader, first: int):
        loaders.append(self)
        if kind == "outage":
            proxy.down = url.split("://", 1)[1].split("/", 1)[1]
        else:
            import s3fs

            s3fs.S3FileSystem(skip_instance_cache=True).rm_file(url)
        return dataloader(self, first)

    monkeypatch.setattr(MapLoader, "_dataloader", break_then_read)
    return loaders


def _skips_and_data(run_dir: Path) -> tuple[Counter, dict[str, int]]:
    """(skip log records as (shard, key, reason), each once; the epoch's `data` record's skip counts)."""
    from naflexclip.train.report import SKIP_LOG_FILE, read_skip_log
    from naflexclip.train.sinks import METRICS_FILE, read_metrics

    logged = Counter((r["source"].rpartition("/")[2], r["key"], r["reason"])
                     for r in read_skip_log(run_dir / SKIP_LOG_FILE) if r["reason"] not in READ_NOTES)
    records = read_metrics(run_dir / METRICS_FILE)
    (data,) = [r for r in records if r["kind"] == "data"]
    counts = {k.rpartition("/")[2]: v for k, v in data.items() if k.startswith("data/skipped/")}
    for note in READ_NOTES:  # retried and throttled reads depend on timing; the samples lost do not
        counts.pop(note, None)
    return logged, counts


@pytest.mark.slow
@pytest.mark.parametrize("kind, reason", [("outage", "unreachable_shard"), ("deleted", "missing_shard")])
def test_a_shard_lost_mid_run_is_counted_once_per_sample_under_one_name_across_a_cut_and_resume(
        bucket, tmp_path: Path, fast_retries, monkeypatch: pytest.MonkeyPatch, kind: str, reason: str) -> None:
    """A shard that the run's startup read fine is lost as its epoch starts reading, for the rest of the run (an
    outage past the retries, or the object deleted), with 2 workers: the run cut at step 2 and resumed skips what
    the uninterrupted run skips, each of the shard's 10 samples once, by the same key and under one name."""
    monkeypatch.setattr(remote, "RETRIES", 1)
    prefix, lost = f"s3://data/lost-{kind}", "train-00002.tar"
    runs = {}
    for name, cuts in (("whole", [[]]), ("part", [["--stop-after-steps", "2", "--save-every-n-steps", "1"],
                                                  ["--resume", "latest"]])):
        monkeypatch.setenv("AWS_ENDPOINT_URL", bucket[0])
        upload(str(bucket[1]), prefix)  # the shard back, at the version (ETag) it had
        with FaultProxy(bucket[0], every=10**9, limit=0) as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            for extra in cuts:
                remote.forget_filesystems()
                with monkeypatch.context() as fault:
                    loaders = _start_fault(kind, f"{prefix}/{lost}", proxy, fault)
                    flags = _train_flags(tmp_path, f"{prefix}/{LOCAL_SPEC}", workers=2)
                    assert main(["train", *flags, "--name", name, *extra]) == 0
        counted = Counter({r: n for r, n in loaders[-1].skip_counts.items() if r not in READ_NOTES})
        runs[name] = (*_skips_and_data(tmp_path / name), counted)  # the loader's: since the run's start
    logged, counts, counted = runs["whole"]
    assert counts == counted == {reason: 10}
    assert sorted(logged) == [(lost, f"train{i:08d}", reason) for i in range(20, 30)]
    assert runs["part"] == runs["whole"]


def _startup_requests(proxy: FaultProxy) -> Counter:
    """The proxy's requests so far by kind: listings, sizes.json, index objects, shard objects (HEAD and GET apart)."""
    kinds: Counter = Counter()
    for (method, path), n in proxy.counts.items():
        name = path.rpartition("/")[2]
        kind = ("index" if name.endswith(".naflexclip-index.json") else "sizes.json" if name == "sizes.json"
                else "shard" if name.endswith(".tar") else "listing")
        kinds[f"{method} {kind}"] += n
    return kinds


@pytest.mark.parametrize("folder", ["sized", "unsized"])
def test_indexes_written_beside_remote_shards_make_startup_a_listing_and_one_read_per_index(
        bucket, tmp_path: Path, folder: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """`naflexclip data index` writes each shard's index beside it; a run with an empty index cache then reads no
    shard byte at startup, sends no HEAD, and trains what the shards hold."""
    source = bucket[1] if folder == "sized" else bucket[2]
    prefix = f"s3://data/indexed-{folder}"
    upload(str(source), prefix)
    expected, _ = epoch_keys(config(str(source / LOCAL_SPEC), tmp_path / "local"))
    assert main(["data", "index", f"{prefix}/{LOCAL_SPEC}"]) == 0
    assert "indexed 4 shards (40 samples)" in capsys.readouterr().out
    with FaultProxy(bucket[0]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        remote.forget_filesystems()
        cfg = config(f"{prefix}/{LOCAL_SPEC}", tmp_path / "fresh")
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
        startup = _startup_requests(proxy)
        keys = [key.rpartition("/")[2] for batch in loader for key in batch["keys"]]
    assert keys == expected and not loader.skip_counts
    assert startup["GET index"] == 4 and "GET shard" not in startup and not any(k.startswith("HEAD") for k in startup)


def test_a_stale_index_beside_a_shard_is_named_and_never_trusted(bucket, tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A shard rewritten after `naflexclip data index`: its index (another size and ETag) is named in one line and
    the shard is indexed again from its headers; what trains is what it holds now."""
    prefix = "s3://data/stale-index"
    upload(str(bucket[2]), prefix)
    assert main(["data", "index", f"{prefix}/{LOCAL_SPEC}"]) == 0
    _rewrite(f"{prefix}/train-00002.tar", bucket[2] / "train-00000.tar")
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        keys, skips = epoch_keys(config(f"{prefix}/{LOCAL_SPEC}", tmp_path))
    said = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
    assert len(said) == 1 and f"{prefix}/train-00002.tar" in said[0], said
    assert not skips
    assert sorted(k for k in keys if k.startswith("train-00002")) == [f"train-00002.tar:train{i:08d}"
                                                                       for i in range(10)]


def test_indexing_without_an_index_reads_each_shard_once_for_all_ranks_and_workers(
        bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No index beside the shards, a fresh cache: two ranks starting at once and their workers (which index a
    shard where --trust-sizes-json left it to them) read each shard's headers once, not once per process."""
    import threading

    once = Counter()
    with FaultProxy(bucket[0]) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        remote.forget_filesystems()
        epoch_keys(config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path / "one"))
        once = _startup_requests(proxy)
    for trusted in (False, True):
        with FaultProxy(bucket[0]) as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            remote.forget_filesystems()
            cfg = config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path / f"two-{trusted}", workers=2,
                         trust_sizes_json=trusted)
            found: list[list[str]] = [[], []]

            def rank(r: int, cfg=cfg, found=found) -> None:
                loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=r,
                                      world_size=2)
                found[r] = [k for batch in loader for k in batch["keys"]]

            threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            both = _startup_requests(proxy)
        assert len(set(found[0] + found[1])) == SAMPLES
        # the samples' own reads are the same; only header reads could be repeated
        assert both["GET shard"] == once["GET shard"], (trusted, both, once)


def test_throttled_reads_back_off_and_are_counted_apart(bucket, tmp_path: Path, fast_retries,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """503 SlowDown and 429: each retry is a `read_throttled` note (not `read_retry`), nothing is lost, and the
    epoch's line says how many."""
    expected, _ = epoch_keys(config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path / "clean"))
    for status in (503, 429):
        with FaultProxy(bucket[0], every=3, limit=8, throttle=status) as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            remote.forget_filesystems()
            loader = build_loader(config(f"s3://data/sized/{LOCAL_SPEC}", tmp_path / f"{status}"), split="train",
                                  patch_size=PATCH, context_length=CONTEXT)
            keys = [key.rpartition("/")[2] for batch in loader for key in batch["keys"]]
        assert keys == expected
        assert set(loader.skip_counts) == {"read_throttled"}, (status, loader.skip_counts)
        assert loader.summary().endswith(f"{loader.skip_counts['read_throttled']} reads throttled"), loader.summary()


def test_a_dead_shard_is_given_up_once_and_skipped_at_once_by_every_worker(bucket, tmp_path: Path, fast_retries,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """train-00002.tar answers 503 to everything: its retries are spent once, by the first reader; every later reader
    (the other worker, later samples) skips it without asking the store again."""
    monkeypatch.setattr(remote, "RETRIES", 2)
    for folder in ("sized", "unsized"):
        with FaultProxy(bucket[0], down="train-00002.tar") as proxy:
            monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
            remote.forget_filesystems()
            keys, skips = epoch_keys(config(f"s3://data/{folder}/{LOCAL_SPEC}", tmp_path / folder, workers=2))
            asked = sum(n for (method, path), n in proxy.counts.items() if path.endswith("train-00002.tar"))
        assert len(keys) == 30 and skips["unreachable_shard"] == (10 if folder == "sized" else 1)
        assert asked == remote.RETRIES + 1, (folder, asked)


def test_a_resume_after_a_dead_shard_continues_exactly(bucket, tmp_path: Path, fast_retries,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "RETRIES", 1)
    with FaultProxy(bucket[0], down="train-00001.tar") as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        remote.forget_filesystems()
        whole, expected, resumed, keys = _cut_and_resumed(tmp_path, between=remote.forget_filesystems)
    assert keys == expected and sum(len(k) for k in expected) == 30
    assert resumed.skip_counts["unreachable_shard"] == whole.skip_counts["unreachable_shard"] == 10


@pytest.mark.parametrize("folder", ["sized", "unsized"])
def test_https_shards_from_a_plain_server_with_ranges_train_as_local_disk(bucket, tmp_path: Path, folder: str) -> None:
    """`https://` data (here plain HTTP on loopback: a file server with byte ranges and no listing): every sample
    once, in the local order, at 0 and 2 workers."""
    source = bucket[1] if folder == "sized" else bucket[2]
    local_keys, _ = epoch_keys(config(str(source / LOCAL_SPEC), tmp_path / "local"))
    with RangeServer(str(source)) as server:
        for workers in (0, 2):
            keys, skips = epoch_keys(config(f"{server.url}/{LOCAL_SPEC}", tmp_path / f"{workers}", workers=workers))
            assert keys == local_keys and not skips
        assert any(method == "GET" and path.endswith(".tar") for method, path in server.counts)

@pytest.mark.parametrize("world_size", [1, 2])
def test_remote_shards_are_read_a_chunk_per_request_each_byte_once(bucket, tmp_path: Path, monkeypatch,
                                                                   world_size: int) -> None:
    """Each chunk (here a whole shard) is fetched in one ranged GET by the one rank that reads it, ahead of its use;
    the samples are the local shards' in the same order."""
    _, local, _, _ = bucket
    cfg = config("s3://data/sized/train-{00000..00003}.tar", tmp_path, fetch_chunk_size=8)
    epoch_keys(cfg)  # the shards' indexes cached
    gets: list[int] = []
    cat = remote._cat_range
    monkeypatch.setattr(remote, "_cat_range", lambda *a: gets.append(a[4] - a[3]) or cat(*a))
    keys, skips = epoch_keys(cfg, world_size)
    local_keys = epoch_keys(config(str(local / LOCAL_SPEC), tmp_path, fetch_chunk_size=8), world_size)[0]
    assert keys == local_keys
    assert len(keys) == SAMPLES and not skips
    shard_bytes = sum(os.path.getsize(local / f"train-{i:05d}.tar") for i in range(4))
    assert len(gets) == 4 and sum(gets) <= shard_bytes


def test_two_loaders_read_at_once_in_one_process_each_fetch_their_own_chunks(bucket, tmp_path: Path,
                                                                            monkeypatch) -> None:
    """Both ranks' loaders read at once in one process (threads, as a train loader beside another): each serves its
    samples from the chunks it fetched, so the epoch is still one GET per chunk."""
    import threading

    cfg = config("s3://data/sized/train-{00000..00003}.tar", tmp_path, fetch_chunk_size=8, workers=2)
    expected, _ = epoch_keys(cfg, 2)  # (also caches the shards' indexes)
    gets: list[int] = []
    cat = remote._cat_range
    monkeypatch.setattr(remote, "_cat_range", lambda *a: gets.append(a[4] - a[3]) or cat(*a))
    keys: list[list[str]] = [[], []]

    def rank(r: int) -> None:
        loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT, rank=r, world_size=2)
        keys[r] = [k.rpartition("/")[2] for batch in loader for k in batch["keys"]]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert keys[0] + keys[1] == expected
    assert len(gets) == 4


def test_an_epoch_stopped_early_lets_go_of_its_fetched_chunks(bucket, tmp_path: Path) -> None:
    """A loop that stops mid-epoch (a run's last step, an evaluation's limit) releases the chunks fetched for the
    rest of the epoch: none is held, and none serves a later loader's reads."""
    cfg = config("s3://data/sized/train-{00000..00003}.tar", tmp_path, fetch_chunk_size=8,
                 naflex_max_tokens_per_batch=32)  # 1 or 2 rows a microbatch: the epoch is 20+ of them
    loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    read = 0
    for batch in loader:
        read += len(batch["keys"])
        if read >= 8:
            break
    assert read < SAMPLES and remote._range_caches == []


def test_a_fetch_memory_below_what_the_order_keeps_in_use_is_never_exceeded(bucket, tmp_path: Path, monkeypatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Four streams each keep a chunk (a shard here) in use at once; a budget of about two chunks holds at most two,
    reads the others' samples one by one (every sample once, no byte fetched twice) and says so at the epoch's start
    with the budget the order needs."""
    from naflexclip.data import chunk_fetch

    cfg = config("s3://data/sized/train-{00000..00003}.tar", tmp_path, fetch_chunk_size=8)
    expected, _ = epoch_keys(cfg)  # (also caches the shards' indexes)
    shard_bytes = [os.path.getsize(bucket[1] / f"train-{i:05d}.tar") for i in range(4)]
    fetchers: list = []
    monkeypatch.setattr(chunk_fetch.ChunkFetcher, "__init__", lambda self, *a, _init=chunk_fetch.ChunkFetcher.__init__:
                        fetchers.append(self) or _init(self, *a))
    fetched: list[int] = []
    cat = remote._cat_range
    monkeypatch.setattr(remote, "_cat_range", lambda *a: fetched.append(a[4] - a[3]) or cat(*a))
    loader = build_loader(cfg, split="train", patch_size=PATCH, context_length=CONTEXT)
    budget = sorted(shard_bytes)[1] * 2
    loader.chunked.memory = budget
    with caplog.at_level("WARNING", logger="naflexclip.data"):
        keys = [key.rpartition("/")[2] for batch in loader for key in batch["keys"]]
    assert keys == expected
    assert max(f.most_held for f in fetchers) <= budget
    assert 4 < len(fetched) and sum(fetched) <= sum(shard_bytes)
    said = [r.getMessage() for r in caplog.records if "--fetch-memory" in r.getMessage()]
    assert len(said) == 1 and "sample by sample" in said[0], said
