//! Sharded checkpoints: round trip, re-sharding, corruption, crash safety, export.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers may panic

use std::fs;
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use safetensors::SafeTensors;
use zeropp_comm::Topology;
use zeropp_partition::checkpoint::{LATEST_FILE, MANIFEST_FILE, shard_file_name, step_dir_name};
use zeropp_partition::{
    BucketShard, Checkpoint, DType, Manifest, ParamRegistry, ParamSpec, PartitionError, PartitionPlan,
    PlanConfig, ShardState, commit_checkpoint, load_checkpoint, save_checkpoint, write_shard,
};

pub(super) fn registry() -> ParamRegistry {
    let mut reg = ParamRegistry::new();
    reg.push_bucket("embed", vec![ParamSpec::new("embed.w", [13, 5], DType::BF16)]).unwrap();
    reg.push_bucket(
        "layer0",
        vec![ParamSpec::new("layer0.w", [5, 7], DType::F16), ParamSpec::new("layer0.b", [7], DType::F32)],
    )
    .unwrap();
    reg.push_bucket("head", vec![ParamSpec::new("head.w", [3, 5], DType::F32)]).unwrap();
    reg
}

pub(super) fn plan(world: usize, local: usize, align: usize, hpz: usize) -> PartitionPlan {
    PartitionPlan::new(
        &registry(),
        Topology::ranks(world).per_node(local).unwrap(),
        PlanConfig::new(align, hpz),
    )
    .unwrap()
}

/// Deterministic, distinct per-element values for the "model state": padding zero.
pub(super) fn full_state(plan: &PartitionPlan, seed: f32) -> Vec<[Vec<f32>; 3]> {
    plan.buckets()
        .iter()
        .enumerate()
        .map(|(b, layout)| {
            let v = |k: f32| -> Vec<f32> {
                (0..layout.numel).map(|i| seed + k * 1000.0 + b as f32 * 100.0 + i as f32 * 0.5).collect()
            };
            [v(0.0), v(1.0), v(2.0)]
        })
        .collect()
}

pub(super) fn shards_of(plan: &PartitionPlan, full: &[[Vec<f32>; 3]]) -> Vec<ShardState> {
    (0..plan.world())
        .map(|r| ShardState {
            buckets: full
                .iter()
                .enumerate()
                .map(|(b, [m, a, s])| BucketShard {
                    master: plan.shard_of(b, r, m).unwrap(),
                    exp_avg: plan.shard_of(b, r, a).unwrap(),
                    exp_avg_sq: plan.shard_of(b, r, s).unwrap(),
                    step: 40 + b as u64,
                })
                .collect(),
            extra: Default::default(),
        })
        .collect()
}

fn save(dir: &Path, plan: &PartitionPlan, step: u64, seed: f32) -> (PathBuf, Vec<ShardState>) {
    let full = full_state(plan, seed);
    let shards = shards_of(plan, &full);
    let cfg = serde_json::json!({"model": "tiny", "lr": 0.001, "seed": seed});
    let path = save_checkpoint(dir, plan, step, &shards, cfg).unwrap();
    (path, shards)
}

/// Saves `plan`'s state at `step` (see [`save`]) in a fresh directory and loads it back.
fn saved_and_loaded(plan: &PartitionPlan, step: u64, seed: f32) -> (tempfile::TempDir, Checkpoint) {
    let tmp = tempfile::tempdir().unwrap();
    save(tmp.path(), plan, step, seed);
    let ck = load_checkpoint(tmp.path()).unwrap();
    (tmp, ck)
}

#[test]
fn round_trip_same_topology() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(4, 2, 4, 2);
    let (path, shards) = save(tmp.path(), &p, 123, 1.0);
    assert_eq!(path, tmp.path().join("step-00000123"));
    assert_eq!(fs::read_to_string(tmp.path().join(LATEST_FILE)).unwrap().trim(), "step-00000123");
    let ck = load_checkpoint(tmp.path()).unwrap();
    assert_eq!(ck.reader().step(), 123);
    assert_eq!(ck.reader().dir(), path);
    assert_eq!(ck.reader().user_config()["model"], "tiny");
    assert_eq!(ck.reader().user_config()["lr"], 0.001);
    let m = ck.reader().manifest();
    assert_eq!((m.topology.world, m.topology.local_size, m.topology.nodes), (4, 2, 2));
    assert_eq!((m.align, m.hpz), (4, 2));
    assert_eq!(m.shards.len(), 4);
    assert_eq!(m.buckets, p.buckets());
    for (r, shard) in shards.iter().enumerate() {
        assert_eq!(&ck.shard_for(&p, r).unwrap(), shard);
    }
    // Loading the folder directly works too.
    assert_eq!(load_checkpoint(&path).unwrap(), ck);
    // Per-bucket step counters survive.
    let steps: Vec<u64> = ck.buckets().iter().map(|b| b.step).collect();
    assert_eq!(steps, vec![40, 41, 42]);
    // Consolidated buffers have padding stripped.
    for (b, layout) in p.buckets().iter().enumerate() {
        assert_eq!(ck.buckets()[b].master.len(), layout.numel);
    }
    // Secondary shards are not in the files: only primary tensors are.
    let bytes = fs::read(path.join(shard_file_name(1, 4))).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert_eq!(names.len(), 3 * 4);
    assert!(names.iter().all(|n| n.ends_with("master")
        || n.ends_with("exp_avg")
        || n.ends_with("exp_avg_sq")
        || n.ends_with("step")));
}

fn reshard(from: (usize, usize, usize, usize), to: (usize, usize, usize, usize)) {
    let src = plan(from.0, from.1, from.2, from.3);
    let (_tmp, ck) = saved_and_loaded(&src, 7, 3.0);
    let dst = ck
        .reader()
        .plan_for(Topology::ranks(to.0).per_node(to.1).unwrap(), PlanConfig::new(to.2, to.3))
        .unwrap();
    let expected = shards_of(&dst, &full_state(&dst, 3.0));
    assert_eq!(expected.len(), to.0);
    for (r, want) in expected.iter().enumerate() {
        assert_eq!(&ck.shard_for(&dst, r).unwrap(), want, "{from:?} -> {to:?} rank {r}");
    }
    // And the re-sharded state saves and loads to the same consolidated state.
    let tmp2 = tempfile::tempdir().unwrap();
    save_checkpoint(tmp2.path(), &dst, 8, &expected, serde_json::Value::Null).unwrap();
    let ck2 = load_checkpoint(tmp2.path()).unwrap();
    assert_eq!(ck2.buckets(), ck.buckets());
}

/// (world, local, align, hpz) before and after: fewer, more, one and many
/// ranks, and a change of node size and alignment.
#[test]
fn reshard_between_topologies() {
    for (from, to) in [
        ((8, 4, 4, 4), (4, 2, 4, 2)),
        ((4, 2, 2, 2), (6, 3, 2, 3)),
        ((8, 8, 8, 8), (1, 1, 1, 1)),
        ((1, 1, 1, 1), (8, 2, 16, 2)),
        ((6, 2, 3, 1), (4, 4, 5, 4)),
    ] {
        eprintln!("reshard {from:?} -> {to:?}");
        reshard(from, to);
    }
}

#[test]
fn shard_for_rejects_a_different_model() {
    let (_tmp, ck) = saved_and_loaded(&plan(2, 2, 1, 1), 1, 0.0);
    let mut other = ParamRegistry::new();
    other.push_bucket("embed", vec![ParamSpec::new("embed.w", [13, 6], DType::BF16)]).unwrap();
    let bad =
        PartitionPlan::new(&other, Topology::ranks(2).per_node(2).unwrap(), PlanConfig::default()).unwrap();
    assert!(matches!(ck.shard_for(&bad, 0), Err(PartitionError::LayoutMismatch(_))));
}

/// A model whose head was transposed (same name, same element count, so the
/// buckets' sizes match) is refused, and the error names the tensor and both
/// shapes, so a user resuming an old checkpoint learns what changed.
#[test]
fn shard_for_names_the_tensor_whose_shape_changed() {
    let (_tmp, ck) = saved_and_loaded(&plan(2, 2, 1, 1), 1, 0.0);
    let mut other = ParamRegistry::new();
    other.push_bucket("embed", vec![ParamSpec::new("embed.w", [13, 5], DType::BF16)]).unwrap();
    other
        .push_bucket(
            "layer0",
            vec![ParamSpec::new("layer0.w", [5, 7], DType::F16), ParamSpec::new("layer0.b", [7], DType::F32)],
        )
        .unwrap();
    other.push_bucket("head", vec![ParamSpec::new("head.w", [5, 3], DType::F32)]).unwrap();
    let bad =
        PartitionPlan::new(&other, Topology::ranks(2).per_node(2).unwrap(), PlanConfig::default()).unwrap();
    let Err(PartitionError::LayoutMismatch(msg)) = ck.shard_for(&bad, 0) else {
        panic!("a transposed head was accepted")
    };
    assert!(msg.contains("head.w [5, 3]") && msg.contains("head.w [3, 5]"), "{msg}");
}

#[test]
fn two_phase_api_with_records_in_any_order() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(4, 4, 2, 4);
    let full = full_state(&p, 5.0);
    let shards = shards_of(&p, &full);
    // Each "rank" writes its own shard (here in reverse order).
    let mut records: Vec<_> =
        (0..4).rev().map(|r| write_shard(tmp.path(), &p, 9, r, &shards[r]).unwrap()).collect();
    assert_eq!(records[0].file, shard_file_name(3, 4));
    // Not committed yet: nothing to load.
    assert!(matches!(load_checkpoint(tmp.path()), Err(PartitionError::NoCheckpoint { .. })));
    records.swap(1, 2);
    let manifest = Manifest::new(&p, 9, serde_json::json!({"x": 1}), records.clone()).unwrap();
    let dir = commit_checkpoint(tmp.path(), &manifest).unwrap();
    let ck = load_checkpoint(tmp.path()).unwrap();
    assert_eq!(ck.reader().dir(), dir);
    assert_eq!(ck.reader().manifest(), &manifest);
    assert_eq!(ck.shard_for(&p, 2).unwrap(), shards[2]);
    // Missing or duplicated records are refused.
    assert!(Manifest::new(&p, 9, serde_json::Value::Null, records[..3].to_vec()).is_err());
    let mut dup = records.clone();
    dup[0] = dup[1].clone();
    assert!(Manifest::new(&p, 9, serde_json::Value::Null, dup).is_err());
}

#[test]
fn write_shard_validates_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(2, 2, 1, 1);
    let mut s = ShardState::zeros(&p, 0).unwrap();
    s.buckets[1].exp_avg.pop();
    assert!(matches!(write_shard(tmp.path(), &p, 1, 0, &s), Err(PartitionError::LengthMismatch { .. })));
    let s = ShardState::zeros(&p, 0).unwrap();
    assert!(matches!(write_shard(tmp.path(), &p, 1, 2, &s), Err(PartitionError::RankOutOfRange { .. })));
}

#[test]
fn from_full_master_initialises_zero_moments() {
    let p = plan(4, 2, 2, 1);
    let full = full_state(&p, 0.0);
    let masters: Vec<&[f32]> = full.iter().map(|f| f[0].as_slice()).collect();
    let s = ShardState::from_full_master(&p, 3, &masters).unwrap();
    for (b, bs) in s.buckets.iter().enumerate() {
        assert_eq!(bs.master, p.shard_of(b, 3, &full[b][0]).unwrap());
        assert!(bs.exp_avg.iter().chain(&bs.exp_avg_sq).all(|&x| x == 0.0));
        assert_eq!(bs.step, 0);
    }
    assert!(ShardState::from_full_master(&p, 3, &masters[..1]).is_err());
}

// ---------------------------------------------------------------- corruption

fn saved_pair() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(4, 2, 2, 2);
    let (path, _) = save(tmp.path(), &p, 50, 0.0);
    (tmp, path)
}

fn err_text(dir: &Path) -> (PartitionError, String) {
    let e = load_checkpoint(dir).unwrap_err();
    let s = e.to_string();
    (e, s)
}

/// Rewrites `file` with `f` applied to its bytes.
pub(super) fn edit_file(file: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = fs::read(file).unwrap();
    f(&mut bytes);
    fs::write(file, bytes).unwrap();
}

/// A flipped byte (the checksum), a cut file (the recorded size) and a missing
/// file: each is its own error, naming the shard.
#[test]
fn flipped_truncated_or_deleted_shards_are_detected() {
    for (rank, damage) in
        ["flip", "truncate", "delete"].into_iter().enumerate().map(|(i, d)| ([2, 1, 3][i], d))
    {
        let (tmp, path) = saved_pair();
        let file = path.join(shard_file_name(rank, 4));
        match damage {
            "flip" => edit_file(&file, |b| {
                let n = b.len();
                b[n - 3] ^= 0x40;
            }),
            "truncate" => edit_file(&file, |b| b.truncate(b.len() - 10)),
            _ => fs::remove_file(&file).unwrap(),
        }
        let (e, s) = err_text(tmp.path());
        let expected = match damage {
            "flip" => matches!(e, PartitionError::ChecksumMismatch { .. }),
            "truncate" => matches!(e, PartitionError::SizeMismatch { .. }),
            _ => matches!(e, PartitionError::MissingFile { .. }),
        };
        assert!(expected, "{damage}: {e:?}");
        assert!(s.contains(&format!("rank-{rank:05}-of-00004.safetensors")), "{damage}: {s}");
    }
}

#[test]
fn swapped_shards_are_detected() {
    let (tmp, path) = saved_pair();
    let a = path.join(shard_file_name(0, 4));
    let b = path.join(shard_file_name(1, 4));
    let (ba, bb) = (fs::read(&a).unwrap(), fs::read(&b).unwrap());
    fs::write(&a, bb).unwrap();
    fs::write(&b, ba).unwrap();
    assert!(load_checkpoint(tmp.path()).is_err());
}

#[test]
fn corrupted_manifest_is_detected() {
    let (tmp, path) = saved_pair();
    let file = path.join(MANIFEST_FILE);
    let orig = fs::read(&file).unwrap();

    // A flipped digit that still parses as JSON.
    let text = String::from_utf8(orig.clone()).unwrap();
    let tampered = text.replacen("\"step\": 50", "\"step\": 51", 1);
    assert_ne!(tampered, text);
    fs::write(&file, &tampered).unwrap();
    let (e, s) = err_text(tmp.path());
    assert!(matches!(e, PartitionError::ChecksumMismatch { .. }), "{e:?}");
    assert!(s.contains(MANIFEST_FILE), "{s}");

    // Truncated.
    fs::write(&file, &orig[..orig.len() / 2]).unwrap();
    let (_, s) = err_text(tmp.path());
    assert!(s.contains(MANIFEST_FILE), "{s}");

    // Not a manifest at all.
    fs::write(&file, b"{}").unwrap();
    let (e, s) = err_text(tmp.path());
    assert!(matches!(e, PartitionError::Corrupt { .. }), "{e:?}");
    assert!(s.contains(MANIFEST_FILE), "{s}");

    // Deleted: LATEST names a folder without a manifest.
    fs::remove_file(&file).unwrap();
    let (e, s) = err_text(tmp.path());
    assert!(matches!(e, PartitionError::MissingFile { .. }), "{e:?}");
    assert!(s.contains(MANIFEST_FILE), "{s}");

    // Restored: loads again.
    fs::write(&file, &orig).unwrap();
    load_checkpoint(tmp.path()).unwrap();
}

#[test]
fn corrupted_latest_pointer_is_detected() {
    let (tmp, _) = saved_pair();
    fs::write(tmp.path().join(LATEST_FILE), "../../etc\n").unwrap();
    let (e, s) = err_text(tmp.path());
    assert!(matches!(e, PartitionError::Corrupt { .. }), "{e:?}");
    assert!(s.contains(LATEST_FILE), "{s}");
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(load_checkpoint(empty.path()), Err(PartitionError::NoCheckpoint { .. })));
}

// ------------------------------------------------------------- crash safety

#[test]
fn save_failing_midway_leaves_previous_checkpoint() {
    let p = plan(4, 2, 2, 2);
    let (tmp, before) = saved_and_loaded(&p, 100, 1.0);

    // Crash after two of four ranks wrote their shards (no commit).
    let shards = shards_of(&p, &full_state(&p, 2.0));
    for (r, shard) in shards.iter().enumerate().take(2) {
        write_shard(tmp.path(), &p, 200, r, shard).unwrap();
    }
    // A leftover temporary file from a rank killed mid-write.
    let step200 = tmp.path().join(step_dir_name(200));
    fs::write(step200.join(format!("{}.tmp", shard_file_name(2, 4))), b"partial").unwrap();
    assert_eq!(load_checkpoint(tmp.path()).unwrap(), before);
    // The partial folder is not loadable on its own either.
    assert!(load_checkpoint(&step200).is_err());

    // Commit refuses while a shard is missing, and LATEST does not move.
    let records: Vec<_> = (0..2).map(|r| write_shard(tmp.path(), &p, 200, r, &shards[r]).unwrap()).collect();
    let mut fake = records.clone();
    for r in 2..4 {
        fake.push(zeropp_partition::ShardRecord { rank: r, file: shard_file_name(r, 4), size: 1, crc32c: 0 });
    }
    let manifest = Manifest::new(&p, 200, serde_json::Value::Null, fake).unwrap();
    assert!(matches!(commit_checkpoint(tmp.path(), &manifest), Err(PartitionError::MissingFile { .. })));
    assert_eq!(load_checkpoint(tmp.path()).unwrap(), before);

    // A save that errors out part-way (bad state for rank 3) also leaves it.
    let mut bad = shards.clone();
    bad[3].buckets[0].master.clear();
    assert!(save_checkpoint(tmp.path(), &p, 300, &bad, serde_json::Value::Null).is_err());
    assert_eq!(load_checkpoint(tmp.path()).unwrap(), before);

    // Retrying the failed step later succeeds and moves LATEST.
    let path = save_checkpoint(tmp.path(), &p, 200, &shards, serde_json::Value::Null).unwrap();
    assert_eq!(path, step200);
    let after = load_checkpoint(tmp.path()).unwrap();
    assert_eq!(after.reader().step(), 200);
    assert_eq!(after.shard_for(&p, 3).unwrap(), shards[3]);
    assert!(!step200.join(format!("{}.tmp", shard_file_name(0, 4))).exists());
    // The old checkpoint is untouched and still loadable by folder.
    assert_eq!(load_checkpoint(&tmp.path().join(step_dir_name(100))).unwrap(), before);
}

#[test]
fn crash_between_manifest_and_latest() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(2, 2, 1, 1);
    save(tmp.path(), &p, 1, 1.0);
    let latest = fs::read(tmp.path().join(LATEST_FILE)).unwrap();
    save(tmp.path(), &p, 2, 2.0);
    // Simulate the crash: LATEST still names step 1.
    fs::write(tmp.path().join(LATEST_FILE), latest).unwrap();
    assert_eq!(load_checkpoint(tmp.path()).unwrap().reader().step(), 1);
    assert_eq!(load_checkpoint(&tmp.path().join(step_dir_name(2))).unwrap().reader().step(), 2);
}

#[test]
fn committed_checkpoints_are_never_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(2, 2, 1, 1);
    let (path, shards) = save(tmp.path(), &p, 5, 1.0);
    let before = fs::read(path.join(shard_file_name(0, 2))).unwrap();
    assert!(matches!(
        write_shard(tmp.path(), &p, 5, 0, &ShardState::zeros(&p, 0).unwrap()),
        Err(PartitionError::CheckpointExists { .. })
    ));
    assert!(matches!(
        save_checkpoint(tmp.path(), &p, 5, &shards, serde_json::Value::Null),
        Err(PartitionError::CheckpointExists { .. })
    ));
    assert_eq!(fs::read(path.join(shard_file_name(0, 2))).unwrap(), before);
    load_checkpoint(tmp.path()).unwrap();
}

// ------------------------------------------------------------------- export

#[test]
fn export_consolidated_safetensors() {
    let p = plan(4, 2, 4, 1);
    let (tmp, ck) = saved_and_loaded(&p, 11, 0.0);
    let out = tmp.path().join("model.safetensors");
    let size = ck.export_safetensors(&out).unwrap();
    let bytes = fs::read(&out).unwrap();
    assert_eq!(bytes.len() as u64, size);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.len(), 4);
    let full = full_state(&p, 0.0);
    for (b, layout) in p.buckets().iter().enumerate() {
        for slot in &layout.params {
            let t = st.tensor(&slot.name).unwrap();
            assert_eq!(t.shape(), slot.shape.as_slice());
            let want = &full[b][0][slot.range()];
            // Each slot keeps its own dtype; 16-bit values widen exactly.
            let (dtype, width, widen): (_, _, fn(&[u8]) -> f32) = match slot.dtype {
                DType::F32 => (safetensors::Dtype::F32, 4, |c| f32::from_le_bytes(c.try_into().unwrap())),
                DType::BF16 => {
                    (safetensors::Dtype::BF16, 2, |c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                }
                DType::F16 => {
                    (safetensors::Dtype::F16, 2, |c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                }
            };
            assert_eq!(t.dtype(), dtype);
            let got: Vec<f32> = t.data().chunks_exact(width).map(widen).collect();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                let tol = if slot.dtype == DType::F32 { 0.0 } else { w.abs() / 128.0 };
                assert!((g - w).abs() <= tol, "{}: {g} vs {w}", slot.name);
            }
            if slot.dtype == DType::F32 {
                assert_eq!(ck.master_of(&slot.name).unwrap(), want);
            }
        }
    }
    assert!(ck.master_of("nope").is_none());
}

// ------------------------------------------------------- random re-sharding

fn topo() -> impl Strategy<Value = (usize, usize, usize, usize)> {
    (1usize..4, 1usize..5, 1usize..6, any::<prop::sample::Index>()).prop_map(|(nodes, local, align, pick)| {
        let divisors: Vec<usize> = (1..=local).filter(|d| local % d == 0).collect();
        (nodes * local, local, align, divisors[pick.index(divisors.len())])
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn reshard_between_random_topologies(from in topo(), to in topo()) {
        reshard(from, to);
    }
}
