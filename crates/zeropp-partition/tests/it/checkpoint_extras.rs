//! Rank-local extra state in checkpoints (e.g. qgZ error-feedback
//! residuals): bitwise round trip, corruption, commit checks, re-sharding,
//! and compatibility with checkpoints written before extras existed.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::Serialize;
use zeropp_comm::Topology;
use zeropp_partition::checkpoint::{
    FORMAT_VERSION, LATEST_FILE, MANIFEST_FILE, shard_file_name, step_dir_name,
};
use zeropp_partition::{
    BucketLayout, Checkpoint, Manifest, PartitionError, PartitionPlan, PlanConfig, ShardState,
    commit_checkpoint, load_checkpoint, save_checkpoint, write_shard,
};

use super::checkpoint::{full_state, plan, shards_of};

/// Arbitrary bit patterns, with the ones a float round trip would not keep
/// sprinkled in: NaN payloads, a signalling NaN, -0.0, subnormals, ±inf.
fn awkward(seed: u32, len: usize) -> Vec<f32> {
    const SPECIAL: [u32; 8] = [
        0x7fc0_1234,
        0x7f80_0001,
        0x8000_0000,
        0x0000_0001,
        0x807f_ffff,
        0x7f80_0000,
        0xff80_0000,
        0xffc0_0000,
    ];
    (0..len as u32)
        .map(|i| {
            if i % 3 == 0 {
                f32::from_bits(SPECIAL[((i / 3 + seed) % 8) as usize])
            } else {
                f32::from_bits((seed ^ i.rotate_left(16)).wrapping_mul(0x9e37_79b9))
            }
        })
        .collect()
}

fn bits(m: &BTreeMap<String, Vec<f32>>) -> BTreeMap<String, Vec<u32>> {
    m.iter().map(|(k, v)| (k.clone(), v.iter().map(|x| x.to_bits()).collect())).collect()
}

/// Shards of `p` with extras on every rank but the last (ranks may differ):
/// one residual per bucket as long as the rank's shard, a scalar, an empty
/// vector and a name with a slash and non-ASCII letters.
fn shards_with_extras(p: &PartitionPlan) -> Vec<ShardState> {
    let mut shards = shards_of(p, &full_state(p, 1.0));
    let last = shards.len() - 1;
    for (r, s) in shards.iter_mut().enumerate() {
        if r == last && last > 0 {
            continue;
        }
        let r = r as u32;
        for b in 0..p.num_buckets() {
            s.extra.insert(format!("qgz.residual.{b}"), awkward(10 * r + b as u32, p.shard_len(b).unwrap()));
        }
        s.extra.insert("loss_scale".into(), vec![65536.0 + r as f32]);
        s.extra.insert("empty".into(), Vec::new());
        s.extra.insert("ef/ränk-état".into(), awkward(99 + r, 5));
    }
    shards
}

fn save_with_extras(dir: &Path, p: &PartitionPlan, step: u64) -> (PathBuf, Vec<ShardState>) {
    let shards = shards_with_extras(p);
    let path = save_checkpoint(dir, p, step, &shards, serde_json::json!({"qgz": true})).unwrap();
    (path, shards)
}

/// [`save_with_extras`] into a fresh directory, and the checkpoint loaded back.
fn saved_with_extras_and_loaded(
    p: &PartitionPlan,
    step: u64,
) -> (tempfile::TempDir, (PathBuf, Vec<ShardState>), Checkpoint) {
    let tmp = tempfile::tempdir().unwrap();
    let saved = save_with_extras(tmp.path(), p, step);
    let ck = load_checkpoint(tmp.path()).unwrap();
    (tmp, saved, ck)
}

fn load_err(dir: &Path) -> (PartitionError, String) {
    let e = load_checkpoint(dir).unwrap_err();
    let s = e.to_string();
    (e, s)
}

/// The manifest file encoding documented on [`Manifest`]: pretty JSON whose
/// first field, `manifest_crc32c`, is the crc32c of the file with that
/// field set to `"00000000"`.
fn manifest_file_bytes<T: Serialize>(m: &T) -> Vec<u8> {
    let body = serde_json::to_string_pretty(m).unwrap();
    let rest = body.strip_prefix("{\n").unwrap();
    let assemble = |crc: &str| format!("{{\n  \"manifest_crc32c\": \"{crc}\",\n{rest}\n");
    let crc = crc32c::crc32c(assemble("00000000").as_bytes());
    assemble(&format!("{crc:08x}")).into_bytes()
}

/// Edits a committed manifest and rewrites it with a valid self-checksum,
/// as a consistent but wrong writer would.
fn rewrite_manifest(step_dir: &Path, edit: impl FnOnce(&mut Manifest)) {
    let file = step_dir.join(MANIFEST_FILE);
    let mut m: Manifest = serde_json::from_slice(&fs::read(&file).unwrap()).unwrap();
    edit(&mut m);
    fs::write(&file, manifest_file_bytes(&m)).unwrap();
}

type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn tensors_of(bytes: &[u8]) -> (Tensors, HashMap<String, String>) {
    let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
    let st = SafeTensors::deserialize(bytes).unwrap();
    let tensors =
        st.iter().map(|(n, t)| (n.to_string(), (t.dtype(), t.shape().to_vec(), t.data().to_vec()))).collect();
    (tensors, meta.metadata().clone().unwrap_or_default())
}

fn serialize(tensors: &Tensors, metadata: HashMap<String, String>) -> Vec<u8> {
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize(views, Some(metadata)).unwrap()
}

/// Rewrites `rank`'s shard file through `edit` (same metadata) and records
/// its new size and crc32c in the manifest: only the tensor-level checks
/// can catch what `edit` did.
fn rewrite_shard(step_dir: &Path, rank: usize, world: usize, edit: impl FnOnce(&mut Tensors)) {
    let file = step_dir.join(shard_file_name(rank, world));
    let (mut tensors, metadata) = tensors_of(&fs::read(&file).unwrap());
    edit(&mut tensors);
    let bytes = serialize(&tensors, metadata);
    fs::write(&file, &bytes).unwrap();
    rewrite_manifest(step_dir, |m| {
        m.shards[rank].size = bytes.len() as u64;
        m.shards[rank].crc32c = crc32c::crc32c(&bytes);
    });
}

// ------------------------------------------------------------- round trip

#[test]
fn extras_round_trip_bitwise() {
    let p = plan(4, 2, 4, 2);
    let (tmp, (path, shards), ck) = saved_with_extras_and_loaded(&p, 77);

    // Listed in the manifest: names and lengths per rank.
    let listed: Vec<_> = shards.iter().map(ShardState::extra_lens).collect();
    assert_eq!(ck.reader().manifest().extras, listed);
    assert_eq!(ck.reader().manifest().extras_of(0)["qgz.residual.1"], p.shard_len(1).unwrap());
    assert_eq!(ck.reader().manifest().extras_of(0)["empty"], 0);
    assert!(ck.reader().manifest().extras_of(3).is_empty());
    assert!(ck.reader().manifest().extras_of(4).is_empty());
    assert!(ck.has_extras());
    assert!(!ck.extras_dropped(&p));

    // Every bit back, per rank, both from the checkpoint and from shard_for.
    for (r, want) in shards.iter().enumerate() {
        assert_eq!(bits(ck.rank_extra(r).unwrap()), bits(&want.extra), "rank {r}");
        let got = ck.shard_for(&p, r).unwrap();
        assert_eq!(got.buckets, want.buckets, "rank {r}");
        assert_eq!(bits(&got.extra), bits(&want.extra), "rank {r}");
    }
    assert!(ck.rank_extra(3).unwrap().is_empty());
    assert!(ck.rank_extra(4).is_none());
    assert!(matches!(ck.shard_for(&p, 4), Err(PartitionError::RankOutOfRange { .. })));

    // In the rank's own file, as f32 tensors under the reserved prefix.
    let (tensors, _) = tensors_of(&fs::read(path.join(shard_file_name(0, 4))).unwrap());
    assert_eq!(tensors.len(), 3 * 4 + shards[0].extra.len());
    let (dtype, shape, _) = &tensors["extra/ef/ränk-état"];
    assert_eq!((*dtype, shape.as_slice()), (Dtype::F32, &[5][..]));
    assert_eq!(tensors["extra/empty"].1, [0]);
    let (last, _) = tensors_of(&fs::read(path.join(shard_file_name(3, 4))).unwrap());
    assert_eq!(last.len(), 3 * 4);

    // Saving what was loaded and loading it again keeps every bit.
    let tmp2 = tempfile::tempdir().unwrap();
    let again: Vec<_> = (0..4).map(|r| ck.shard_for(&p, r).unwrap()).collect();
    save_checkpoint(tmp2.path(), &p, 78, &again, serde_json::Value::Null).unwrap();
    let ck2 = load_checkpoint(tmp2.path()).unwrap();
    for (r, want) in shards.iter().enumerate() {
        assert_eq!(bits(ck2.rank_extra(r).unwrap()), bits(&want.extra), "rank {r}");
    }
    assert_eq!(ck2.buckets(), ck.buckets());

    // Extras are not model weights: the consolidated export leaves them out.
    let out = tmp.path().join("model.safetensors");
    ck.export_safetensors(&out).unwrap();
    let (exported, _) = tensors_of(&fs::read(&out).unwrap());
    assert_eq!(exported.len(), 4);
    assert!(exported.keys().all(|n| !n.starts_with("extra")), "{:?}", exported.keys());
}

// ------------------------------------------------------------- corruption

fn saved_with_extras() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (path, _) = save_with_extras(tmp.path(), &plan(4, 2, 2, 2), 60);
    (tmp, path)
}

#[test]
fn flipped_or_cut_extra_bytes_are_detected() {
    // A flipped bit inside an extra: the file checksum catches it.
    let (tmp, path) = saved_with_extras();
    let file = path.join(shard_file_name(1, 4));
    let mut bytes = fs::read(&file).unwrap();
    let (n, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let (start, _) = meta.info("extra/loss_scale").unwrap().data_offsets;
    bytes[8 + n + start] ^= 0x01;
    fs::write(&file, &bytes).unwrap();
    let (e, s) = load_err(tmp.path());
    assert!(matches!(e, PartitionError::ChecksumMismatch { .. }), "{e:?}");
    assert!(s.contains("rank-00001-of-00004.safetensors"), "{s}");

    // A file cut inside an extra: the recorded size catches it.
    let (tmp, path) = saved_with_extras();
    let file = path.join(shard_file_name(2, 4));
    let bytes = fs::read(&file).unwrap();
    let (n, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let (start, _) = meta.info("extra/qgz.residual.0").unwrap().data_offsets;
    fs::write(&file, &bytes[..8 + n + start + 2]).unwrap();
    let (e, s) = load_err(tmp.path());
    assert!(matches!(e, PartitionError::SizeMismatch { .. }), "{e:?}");
    assert!(s.contains("rank-00002-of-00004.safetensors"), "{s}");
}

#[test]
fn extras_that_disagree_with_the_manifest_are_corrupt_naming_the_file() {
    // The helpers reproduce the manifest encoding exactly.
    let (tmp, path) = saved_with_extras();
    let before = fs::read(path.join(MANIFEST_FILE)).unwrap();
    rewrite_manifest(&path, |_| {});
    assert_eq!(fs::read(path.join(MANIFEST_FILE)).unwrap(), before);
    rewrite_shard(&path, 1, 4, |_| {});
    load_checkpoint(tmp.path()).unwrap();

    type Edit = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Edit, &str, &str)> = vec![
        (
            "missing",
            Box::new(|d| rewrite_shard(d, 2, 4, |t| drop(t.remove("extra/loss_scale").unwrap()))),
            "rank-00002-of-00004.safetensors",
            "extra/loss_scale listed in the manifest is missing",
        ),
        (
            "truncated",
            Box::new(|d| {
                rewrite_shard(d, 1, 4, |t| {
                    let (_, shape, data) = t.get_mut("extra/qgz.residual.0").unwrap();
                    shape[0] -= 1;
                    data.truncate(data.len() - 4);
                })
            }),
            "rank-00001-of-00004.safetensors",
            "extra/qgz.residual.0 is F32",
        ),
        (
            "retyped",
            Box::new(|d| rewrite_shard(d, 0, 4, |t| t.get_mut("extra/loss_scale").unwrap().0 = Dtype::U32)),
            "rank-00000-of-00004.safetensors",
            "extra/loss_scale is U32",
        ),
        (
            "unlisted",
            Box::new(|d| {
                rewrite_shard(d, 3, 4, |t| {
                    t.insert("extra/stowaway".into(), (Dtype::F32, vec![1], 1f32.to_le_bytes().to_vec()));
                })
            }),
            "rank-00003-of-00004.safetensors",
            "extra/stowaway is not listed",
        ),
        (
            "listed longer than saved",
            Box::new(|d| rewrite_manifest(d, |m| *m.extras[0].get_mut("ef/ränk-état").unwrap() = 6)),
            "rank-00000-of-00004.safetensors",
            "the manifest lists F32[6]",
        ),
        (
            "listed for a rank that saved none",
            Box::new(|d| {
                rewrite_manifest(d, |m| {
                    m.extras[3].insert("ghost".into(), 1);
                })
            }),
            "rank-00003-of-00004.safetensors",
            "extra/ghost listed in the manifest is missing",
        ),
        (
            "one listing short",
            Box::new(|d| rewrite_manifest(d, |m| drop(m.extras.pop()))),
            MANIFEST_FILE,
            "extras listings",
        ),
        (
            "empty name listed",
            Box::new(|d| {
                rewrite_manifest(d, |m| {
                    m.extras[1].insert(String::new(), 0);
                })
            }),
            MANIFEST_FILE,
            "empty",
        ),
    ];
    for (what, edit, file, reason) in cases {
        let (tmp, path) = saved_with_extras();
        edit(&path);
        let (e, s) = load_err(tmp.path());
        assert!(matches!(e, PartitionError::Corrupt { .. }), "{what}: {e:?}");
        assert!(s.contains(file), "{what}: {s}");
        assert!(s.contains(reason), "{what}: {s}");
    }
}

// ----------------------------------------------------------------- commit

#[test]
fn commit_refuses_a_manifest_that_does_not_list_the_extras() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(2, 2, 1, 1);
    let shards = shards_with_extras(&p); // rank 0 has extras, rank 1 none
    let records: Vec<_> = (0..2).map(|r| write_shard(tmp.path(), &p, 5, r, &shards[r]).unwrap()).collect();
    let listings: Vec<_> = shards.iter().map(ShardState::extra_lens).collect();
    let step_dir = tmp.path().join(step_dir_name(5));
    let nothing_committed = || {
        assert!(!step_dir.join(MANIFEST_FILE).exists());
        assert!(!tmp.path().join(LATEST_FILE).exists());
    };

    // Built without with_extras (an engine that forgot them): refused,
    // naming the file, so that no committed checkpoint fails to load.
    let bare = Manifest::new(&p, 5, serde_json::Value::Null, records.clone()).unwrap();
    assert!(bare.extras.is_empty());
    let e = commit_checkpoint(tmp.path(), &bare).unwrap_err();
    let s = e.to_string();
    assert!(matches!(e, PartitionError::Corrupt { .. }), "{e:?}");
    assert!(s.contains("rank-00000-of-00002.safetensors") && s.contains("not listed"), "{s}");
    nothing_committed();

    // A listing that disagrees with the file: refused too.
    let mut wrong = listings.clone();
    wrong[0].insert("loss_scale".into(), 2);
    let m =
        Manifest::new(&p, 5, serde_json::Value::Null, records.clone()).unwrap().with_extras(wrong).unwrap();
    let s = commit_checkpoint(tmp.path(), &m).unwrap_err().to_string();
    assert!(s.contains("rank-00000-of-00002.safetensors") && s.contains("extra/loss_scale"), "{s}");
    nothing_committed();

    // Not one listing per rank, or bad names: refused when building.
    let new = || Manifest::new(&p, 5, serde_json::Value::Null, records.clone()).unwrap();
    assert!(matches!(
        new().with_extras(vec![listings[0].clone()]),
        Err(PartitionError::LengthMismatch { expected: 2, actual: 1, .. })
    ));
    let bad_name = vec![BTreeMap::from([("a\tb".to_string(), 1)]), BTreeMap::new()];
    assert!(matches!(new().with_extras(bad_name), Err(PartitionError::InvalidConfig(_))));
    // Empty listings for every rank are no listing at all.
    assert!(new().with_extras(vec![BTreeMap::new(); 2]).unwrap().extras.is_empty());

    // write_shard refuses bad names.
    for name in ["", "new\nline"] {
        let mut s = shards[1].clone();
        s.extra.insert(name.into(), vec![1.0]);
        assert!(
            matches!(write_shard(tmp.path(), &p, 6, 1, &s), Err(PartitionError::InvalidConfig(_))),
            "{name:?}"
        );
    }

    // The right listing commits, and loads bit for bit.
    let good = new().with_extras(listings).unwrap();
    assert_eq!(commit_checkpoint(tmp.path(), &good).unwrap(), step_dir);
    let ck = load_checkpoint(tmp.path()).unwrap();
    assert_eq!(ck.reader().manifest(), &good);
    for (r, want) in shards.iter().enumerate() {
        assert_eq!(bits(&ck.shard_for(&p, r).unwrap().extra), bits(&want.extra));
    }
}

// ------------------------------------------------------------- re-sharding

#[test]
fn resharding_drops_extras_and_says_so() {
    let p = plan(4, 2, 4, 2);
    let (_tmp, (_, shards), ck) = saved_with_extras_and_loaded(&p, 9);

    // (world, local_size, align, hpz) -> extras dropped?
    let cases = [
        ((4, 2, 4, 2), false), // the saved plan
        ((4, 2, 4, 1), false), // only the hpZ group differs: same primary shards
        ((2, 2, 4, 2), true),  // fewer ranks
        ((8, 4, 4, 2), true),  // more ranks
        ((4, 4, 4, 2), true),  // same world, other ranks per node
        ((4, 2, 1, 2), true),  // same topology, alignment changes the padding
    ];
    let aligned =
        ck.reader().plan_for(Topology::ranks(4).per_node(2).unwrap(), PlanConfig::new(1, 2)).unwrap();
    assert_ne!(aligned.buckets(), p.buckets(), "the alignment case must change the layouts");
    for ((w, l, align, hpz), dropped) in cases {
        let dst = ck
            .reader()
            .plan_for(Topology::ranks(w).per_node(l).unwrap(), PlanConfig::new(align, hpz))
            .unwrap();
        assert_eq!(ck.extras_dropped(&dst), dropped, "{w}x{l} align {align} hpz {hpz}");
        let expected = shards_of(&dst, &full_state(&dst, 1.0));
        for (r, want) in expected.iter().enumerate() {
            let got = ck.shard_for(&dst, r).unwrap();
            assert_eq!(got.buckets, want.buckets, "{w}x{l} rank {r}");
            if dropped {
                assert!(got.extra.is_empty(), "{w}x{l} rank {r}");
            } else {
                assert_eq!(bits(&got.extra), bits(&shards[r].extra), "{w}x{l} rank {r}");
            }
        }
    }
    // The saved extras stay readable for a caller that maps them itself.
    assert_eq!(bits(ck.rank_extra(0).unwrap()), bits(&shards[0].extra));

    // Nothing is dropped from a checkpoint that has no extras.
    let tmp2 = tempfile::tempdir().unwrap();
    save_checkpoint(tmp2.path(), &p, 9, &shards_of(&p, &full_state(&p, 1.0)), serde_json::Value::Null)
        .unwrap();
    let plain = load_checkpoint(tmp2.path()).unwrap();
    assert!(!plain.has_extras());
    let other =
        plain.reader().plan_for(Topology::ranks(2).per_node(2).unwrap(), PlanConfig::default()).unwrap();
    assert!(!plain.extras_dropped(&other));
}

// ----------------------------------------------------------- compatibility

/// The manifest as written before extras existed, field for field.
#[derive(Serialize)]
struct V1Manifest<'a> {
    format_version: u32,
    step: u64,
    topology: V1Topology,
    align: usize,
    hpz: usize,
    buckets: &'a [BucketLayout],
    user_config: serde_json::Value,
    shards: Vec<V1Record>,
}

#[derive(Serialize)]
struct V1Topology {
    world: usize,
    local_size: usize,
    nodes: usize,
}

#[derive(Serialize)]
struct V1Record {
    rank: usize,
    file: String,
    size: u64,
    crc32c: u32,
}

fn f32_le(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes, by hand, a checkpoint in the format of before extras existed.
fn write_v1_checkpoint(dir: &Path, p: &PartitionPlan, step: u64, shards: &[ShardState]) {
    let step_dir = dir.join(step_dir_name(step));
    fs::create_dir_all(&step_dir).unwrap();
    let world = p.world();
    let mut records = Vec::new();
    for (r, s) in shards.iter().enumerate() {
        let mut tensors = Tensors::new();
        for (b, bs) in s.buckets.iter().enumerate() {
            let f32s = |v: &[f32]| (Dtype::F32, vec![v.len()], f32_le(v));
            tensors.insert(format!("bucket.{b:05}.master"), f32s(&bs.master));
            tensors.insert(format!("bucket.{b:05}.exp_avg"), f32s(&bs.exp_avg));
            tensors.insert(format!("bucket.{b:05}.exp_avg_sq"), f32s(&bs.exp_avg_sq));
            tensors
                .insert(format!("bucket.{b:05}.step"), (Dtype::U64, vec![1], bs.step.to_le_bytes().to_vec()));
        }
        // The v1 shard metadata, spelled as it stands in the file's header.
        let metadata = serde_json::from_value(serde_json::json!({
            "format": "zeropp-shard",
            "format_version": "1",
            "rank": r.to_string(),
            "world": world.to_string(),
            "step": step.to_string(),
            "buckets": s.buckets.len().to_string(),
        }))
        .unwrap();
        let bytes = serialize(&tensors, metadata);
        let file = shard_file_name(r, world);
        fs::write(step_dir.join(&file), &bytes).unwrap();
        records.push(V1Record { rank: r, file, size: bytes.len() as u64, crc32c: crc32c::crc32c(&bytes) });
    }
    let t = p.topology();
    let manifest = V1Manifest {
        format_version: 1,
        step,
        topology: V1Topology { world, local_size: t.local_size(), nodes: t.nodes() },
        align: p.config().align,
        hpz: p.config().hpz,
        buckets: p.buckets(),
        user_config: serde_json::json!({"written_by": "v1"}),
        shards: records,
    };
    fs::write(step_dir.join(MANIFEST_FILE), manifest_file_bytes(&manifest)).unwrap();
    fs::write(dir.join(LATEST_FILE), format!("{}\n", step_dir_name(step))).unwrap();
}

/// A manifest as JSON without its checksums (shard crc32cs depend on the
/// order safetensors writes the metadata map in, which is not fixed).
fn manifest_sans_checksums(path: &Path) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_slice(&fs::read(path).unwrap()).unwrap();
    let obj = v.as_object_mut().unwrap();
    obj.remove("manifest_crc32c").unwrap();
    for s in obj["shards"].as_array_mut().unwrap() {
        s.as_object_mut().unwrap().remove("crc32c").unwrap();
    }
    v
}

#[test]
fn checkpoints_written_before_extras_still_load() {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(4, 2, 2, 2);
    let shards = shards_of(&p, &full_state(&p, 4.0));
    write_v1_checkpoint(tmp.path(), &p, 31, &shards);

    let ck = load_checkpoint(tmp.path()).unwrap();
    assert_eq!(ck.reader().step(), 31);
    assert_eq!(ck.reader().manifest().format_version, FORMAT_VERSION);
    assert!(ck.reader().manifest().extras.is_empty());
    assert!(!ck.has_extras());
    for (r, want) in shards.iter().enumerate() {
        assert_eq!(&ck.shard_for(&p, r).unwrap(), want);
        assert_eq!(ck.rank_extra(r), Some(&BTreeMap::new()));
    }
    let other = ck.reader().plan_for(Topology::ranks(2).per_node(2).unwrap(), PlanConfig::default()).unwrap();
    assert!(!ck.extras_dropped(&other));

    // Today's writer, given no extras, writes that same format: the same
    // manifest (no "extras" key) and shard files with the same tensors
    // and metadata.
    let tmp2 = tempfile::tempdir().unwrap();
    let new_dir =
        save_checkpoint(tmp2.path(), &p, 31, &shards, serde_json::json!({"written_by": "v1"})).unwrap();
    let old_dir = tmp.path().join(step_dir_name(31));
    let text = fs::read_to_string(new_dir.join(MANIFEST_FILE)).unwrap();
    assert!(!text.contains("\"extras\""), "{text}");
    assert_eq!(
        manifest_sans_checksums(&new_dir.join(MANIFEST_FILE)),
        manifest_sans_checksums(&old_dir.join(MANIFEST_FILE))
    );
    for r in 0..4 {
        let file = shard_file_name(r, 4);
        let new = fs::read(new_dir.join(&file)).unwrap();
        let old = fs::read(old_dir.join(&file)).unwrap();
        assert_eq!(new.len(), old.len(), "{file}");
        assert_eq!(tensors_of(&new), tensors_of(&old), "{file}");
    }
    assert_eq!(load_checkpoint(tmp2.path()).unwrap().buckets(), ck.buckets());
}
