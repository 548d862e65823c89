//! Streaming checkpoint reads ([`CheckpointReader`]): re-sharding and export
//! equal, bit for bit, to the consolidating path ([`load_checkpoint`]), which
//! serves as the reference; corruption still detected; and peak heap memory
//! within one rank's share plus one bucket, where the consolidating path is
//! not.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use zeropp_comm::Topology;
use zeropp_partition::checkpoint::{CHUNK_BYTES, shard_file_name};
use zeropp_partition::{
    BucketShard, CheckpointReader, DType, Manifest, ParamRegistry, ParamSpec, PartitionError, PartitionPlan,
    PlanConfig, ShardState, load_checkpoint, save_checkpoint,
};

use super::alloc_count::peak_during;

/// One parameter: shape and dtype (the name is derived from its position).
type Param = (Vec<usize>, DType);

fn registry(buckets: &[Vec<Param>]) -> ParamRegistry {
    let mut reg = ParamRegistry::new();
    for (b, params) in buckets.iter().enumerate() {
        let specs = params
            .iter()
            .enumerate()
            .map(|(i, (shape, dtype))| ParamSpec::new(format!("b{b}.p{i}"), shape.clone(), *dtype))
            .collect();
        reg.push_bucket(format!("bucket{b}"), specs).unwrap();
    }
    reg
}

/// `(world, local, align, hpz, param_align)`.
type Cfg = (usize, usize, usize, usize, usize);

fn plan(reg: &ParamRegistry, (world, local, align, hpz, param_align): Cfg) -> PartitionPlan {
    PartitionPlan::new(
        reg,
        Topology::ranks(world).per_node(local).unwrap(),
        PlanConfig::new(align, hpz).with_param_align(param_align),
    )
    .unwrap()
}

/// Distinct bit patterns per (seed, tensor, element), NaN payloads and
/// signed zeros included: a float round trip or a misplaced element shows.
fn value(seed: u32, k: u32, i: usize) -> f32 {
    let x =
        (seed.wrapping_mul(0x9e37_79b9) ^ k.wrapping_mul(0x85eb_ca6b) ^ (i as u32).wrapping_mul(0xc2b2_ae35))
            .rotate_left(7);
    match i % 11 {
        3 => f32::from_bits(0x7fc0_0000 | (x & 0xffff)),
        7 => -0.0,
        _ => f32::from_bits(x & 0xbfff_ffff),
    }
}

/// Every rank's state of a model saved under `p`: per-element values, zero
/// padding, per-bucket step counters, and (optionally) extras on every rank.
fn states(p: &PartitionPlan, seed: u32, extras: bool) -> Vec<ShardState> {
    (0..p.world())
        .map(|r| {
            let buckets = p
                .buckets()
                .iter()
                .enumerate()
                .map(|(b, layout)| {
                    let full = |k: u32| -> Vec<f32> {
                        (0..layout.numel).map(|i| value(seed, k + 3 * b as u32, i)).collect()
                    };
                    BucketShard {
                        master: p.shard_of(b, r, &full(0)).unwrap(),
                        exp_avg: p.shard_of(b, r, &full(1)).unwrap(),
                        exp_avg_sq: p.shard_of(b, r, &full(2)).unwrap(),
                        step: 17 + b as u64,
                    }
                })
                .collect();
            let mut extra = BTreeMap::new();
            if extras {
                extra.insert(
                    "residual".to_string(),
                    (0..5 + r).map(|i| value(seed, 99, i + 100 * r)).collect(),
                );
                extra.insert("empty".to_string(), Vec::new());
            }
            ShardState { buckets, extra }
        })
        .collect()
}

/// A state as bits: per bucket (master, exp_avg, exp_avg_sq), steps, extras.
type Bits = (Vec<[Vec<u32>; 3]>, Vec<u64>, BTreeMap<String, Vec<u32>>);

fn bits(s: &ShardState) -> Bits {
    let v = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    (
        s.buckets.iter().map(|b| [v(&b.master), v(&b.exp_avg), v(&b.exp_avg_sq)]).collect(),
        s.buckets.iter().map(|b| b.step).collect(),
        s.extra.iter().map(|(k, x)| (k.clone(), v(x))).collect(),
    )
}

/// Saves under `from`, then checks that every rank of `to` reads the same
/// state bit for bit from the reader as from the consolidated checkpoint,
/// and that the streamed export equals the consolidated one.
fn check_reshard(params: &[Vec<Param>], from: Cfg, to: Cfg, extras: bool) {
    let reg = registry(params);
    let saved = plan(&reg, from);
    let tmp = tempfile::tempdir().unwrap();
    save_checkpoint(tmp.path(), &saved, 9, &states(&saved, 5, extras), serde_json::json!({})).unwrap();
    let reference = load_checkpoint(tmp.path()).unwrap();
    let reader = CheckpointReader::open(tmp.path()).unwrap();
    assert_eq!(reader.manifest(), reference.reader().manifest());
    let new = plan(&reg, to);
    assert_eq!(reader.extras_dropped(&new), reference.extras_dropped(&new));
    assert_eq!(reader.has_extras(), reference.has_extras());
    // All ranks at once (each file read once), in reverse order.
    let ranks: Vec<usize> = (0..new.world()).rev().collect();
    let batch = reader.shards_for(&new, &ranks).unwrap();
    for (&r, together) in ranks.iter().zip(&batch) {
        let want = reference.shard_for(&new, r).unwrap();
        let got = reader.shard_for(&new, r).unwrap();
        assert_eq!(bits(&got), bits(&want), "rank {r} of {to:?} from {from:?}");
        assert_eq!(bits(together), bits(&want), "rank {r} of {to:?} from {from:?}, in a batch");
    }
    reader.verify().unwrap();
    let (a, b) = (tmp.path().join("old.safetensors"), tmp.path().join("new.safetensors"));
    let size_old = reference.export_safetensors(&a).unwrap();
    let size_new = reader.export_safetensors(&b).unwrap();
    assert_eq!(size_old, size_new);
    assert_same_export(&fs::read(&a).unwrap(), &fs::read(&b).unwrap());
}

/// The two exports are the same file up to the order of the metadata keys
/// (`safetensors::serialize` writes its metadata map in hash order): same
/// length, same header as JSON, same tensor bytes; and both load.
fn assert_same_export(old: &[u8], new: &[u8]) {
    assert_eq!(old.len(), new.len());
    let n = u64::from_le_bytes(old[..8].try_into().unwrap()) as usize;
    assert_eq!(old[..8], new[..8], "header length");
    let json = |b: &[u8]| serde_json::from_slice::<serde_json::Value>(&b[8..8 + n]).unwrap();
    assert_eq!(json(old), json(new), "header");
    assert!(old[8 + n..] == new[8 + n..], "tensor bytes differ");
    let (a, b) = (SafeTensors::deserialize(old).unwrap(), SafeTensors::deserialize(new).unwrap());
    assert_eq!(a.names().len(), b.names().len());
    for name in a.names() {
        let (x, y) = (a.tensor(name).unwrap(), b.tensor(name).unwrap());
        assert_eq!((x.dtype(), x.shape(), x.data()), (y.dtype(), y.shape(), y.data()), "{name}");
    }
}

fn small_model() -> Vec<Vec<Param>> {
    vec![
        vec![(vec![13, 5], DType::BF16)],
        vec![(vec![5, 7], DType::F16), (vec![7], DType::F32)],
        vec![(vec![3, 5], DType::F32), (vec![1], DType::F32), (vec![2, 2], DType::BF16)],
    ]
}

#[test]
fn reshard_matches_the_consolidating_path() {
    let cases: [(Cfg, Cfg); 6] = [
        ((8, 4, 4, 2, 1), (4, 2, 4, 2, 1)),
        ((4, 2, 2, 1, 1), (6, 3, 1, 3, 1)),
        ((8, 4, 1, 1, 1), (1, 1, 1, 1, 1)),
        ((1, 1, 1, 1, 1), (8, 4, 2, 4, 1)),
        ((6, 3, 3, 1, 4), (4, 4, 2, 2, 1)),
        ((4, 2, 2, 2, 1), (4, 2, 2, 2, 8)),
    ];
    for (from, to) in cases {
        check_reshard(&small_model(), from, to, false);
    }
}

#[test]
fn extras_follow_the_saved_partitioning() {
    // Same partitioning (hpZ may differ): extras come back bit for bit.
    check_reshard(&small_model(), (4, 2, 2, 1, 1), (4, 2, 2, 2, 1), true);
    // Another world size: dropped, and the reader says so like the reference.
    check_reshard(&small_model(), (4, 2, 2, 1, 1), (2, 2, 2, 1, 1), true);
    // So many ranks that some own only padding: they still get their extras.
    check_reshard(&[vec![(vec![2], DType::F32)]], (8, 4, 1, 1, 1), (8, 4, 1, 2, 1), true);
}

#[test]
fn ranks_owning_only_padding_read_step_counters() {
    // 3 elements over 8 ranks: ranks 3..8 own padding only and touch no file
    // for their values; they still get the step counter (from rank 0's file).
    check_reshard(&[vec![(vec![3], DType::F32)]], (2, 2, 1, 1, 1), (8, 4, 1, 1, 1), false);
    let reg = registry(&[vec![(vec![3], DType::F32)]]);
    let saved = plan(&reg, (2, 2, 1, 1, 1));
    let tmp = tempfile::tempdir().unwrap();
    save_checkpoint(tmp.path(), &saved, 1, &states(&saved, 1, false), serde_json::json!({})).unwrap();
    let s = CheckpointReader::open(tmp.path()).unwrap().shard_for(&plan(&reg, (8, 4, 1, 1, 1)), 7).unwrap();
    assert_eq!(s.buckets[0].step, 17);
    assert_eq!(s.buckets[0].master, [0.0]);
}

#[test]
fn rejects_another_model_and_bad_ranks() {
    let reg = registry(&small_model());
    let saved = plan(&reg, (2, 2, 1, 1, 1));
    let tmp = tempfile::tempdir().unwrap();
    save_checkpoint(tmp.path(), &saved, 1, &states(&saved, 1, false), serde_json::json!({})).unwrap();
    let reader = CheckpointReader::open(tmp.path()).unwrap();
    let other = plan(&registry(&[vec![(vec![3], DType::F32)]]), (2, 2, 1, 1, 1));
    assert!(matches!(reader.shard_for(&other, 0), Err(PartitionError::LayoutMismatch(_))));
    assert!(matches!(reader.shard_for(&saved, 2), Err(PartitionError::RankOutOfRange { .. })));
    assert!(matches!(reader.shards_for(&saved, &[1, 0, 1]), Err(PartitionError::InvalidConfig(_))));
    assert!(reader.shards_for(&saved, &[]).unwrap().is_empty());
}

// ------------------------------------------------------------ corruption

/// A saved 4-rank checkpoint of the small model and its step folder.
fn saved4() -> (tempfile::TempDir, PathBuf, PartitionPlan) {
    let tmp = tempfile::tempdir().unwrap();
    let p = plan(&registry(&small_model()), (4, 2, 2, 1, 1));
    let dir = save_checkpoint(tmp.path(), &p, 3, &states(&p, 2, true), serde_json::json!({})).unwrap();
    (tmp, dir, p)
}

fn shard_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(shard_file_name(rank, 4))
}

/// Every streaming path fails on the checkpoint, naming `file`.
fn all_paths_fail(dir: &Path, p: &PartitionPlan, rank: usize, file: &Path, check: impl Fn(&PartitionError)) {
    let reader = CheckpointReader::open(dir).unwrap();
    let errors = [
        reader.shard_for(p, rank).unwrap_err(),
        reader.verify().unwrap_err(),
        reader.export_safetensors(&dir.join("out.safetensors")).unwrap_err(),
    ];
    for e in &errors {
        check(e);
        assert!(e.to_string().contains(&file.display().to_string()), "{e}");
    }
    assert!(!dir.join("out.safetensors").exists(), "a failed export leaves no file");
}

#[test]
fn flipped_data_byte_is_a_checksum_mismatch() {
    let (_tmp, dir, p) = saved4();
    let path = shard_path(&dir, 2);
    let mut bytes = fs::read(&path).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x10;
    fs::write(&path, &bytes).unwrap();
    all_paths_fail(&dir, &p, 2, &path, |e| {
        assert!(matches!(e, PartitionError::ChecksumMismatch { .. }), "{e}")
    });
    // A rank that does not read rank 2's file is unaffected.
    let s = CheckpointReader::open(&dir).unwrap().shard_for(&p, 0).unwrap();
    assert_eq!(bits(&s), bits(&states(&p, 2, true)[0]));
}

#[test]
fn flipped_header_byte_is_a_checksum_mismatch_not_a_parse_error() {
    let (_tmp, dir, p) = saved4();
    let path = shard_path(&dir, 1);
    let mut bytes = fs::read(&path).unwrap();
    bytes[12] ^= 0x55;
    fs::write(&path, &bytes).unwrap();
    all_paths_fail(&dir, &p, 1, &path, |e| {
        assert!(matches!(e, PartitionError::ChecksumMismatch { .. }), "{e}")
    });
}

#[test]
fn truncated_or_missing_shard_is_detected() {
    let (_tmp, dir, p) = saved4();
    let path = shard_path(&dir, 3);
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
    all_paths_fail(&dir, &p, 3, &path, |e| assert!(matches!(e, PartitionError::SizeMismatch { .. }), "{e}"));
    fs::remove_file(&path).unwrap();
    all_paths_fail(&dir, &p, 3, &path, |e| assert!(matches!(e, PartitionError::MissingFile { .. }), "{e}"));
}

#[test]
fn swapped_shards_are_detected() {
    let (_tmp, dir, p) = saved4();
    let (a, b) = (shard_path(&dir, 0), shard_path(&dir, 1));
    let tmp = dir.join("swap");
    fs::rename(&a, &tmp).unwrap();
    fs::rename(&b, &a).unwrap();
    fs::rename(&tmp, &b).unwrap();
    // Ranks 0 and 1 saved extras of different lengths (5 and 6 values), so
    // the sizes differ; with equal sizes the checksum would catch it.
    all_paths_fail(&dir, &p, 0, &a, |e| {
        assert!(
            matches!(e, PartitionError::ChecksumMismatch { .. } | PartitionError::SizeMismatch { .. }),
            "{e}"
        )
    });
}

#[test]
fn corrupted_manifest_fails_at_open() {
    let (_tmp, dir, _p) = saved4();
    let path = dir.join("manifest.json");
    let mut bytes = fs::read(&path).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x01;
    fs::write(&path, &bytes).unwrap();
    assert!(matches!(CheckpointReader::open(&dir), Err(PartitionError::ChecksumMismatch { .. })));
}

/// A shard file's tensors: name -> (dtype, shape, bytes).
type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// Rewrites `rank`'s shard file of a 4-rank checkpoint through `edit` and
/// records its new size and crc32c in a re-checksummed manifest, as a
/// consistent but wrong writer would: only the header and tensor checks can
/// catch what `edit` did.
fn rewrite_shard(
    dir: &Path,
    rank: usize,
    edit: impl FnOnce(&mut BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>),
) {
    let file = shard_path(dir, rank);
    let bytes = fs::read(&file).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<_, _> =
        st.iter().map(|(n, t)| (n.to_string(), (t.dtype(), t.shape().to_vec(), t.data().to_vec()))).collect();
    edit(&mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let bytes = safetensors::serialize(views, meta.metadata().clone()).unwrap();
    fs::write(&file, &bytes).unwrap();
    let path = dir.join("manifest.json");
    let mut m: Manifest = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    m.shards[rank].size = bytes.len() as u64;
    m.shards[rank].crc32c = crc32c::crc32c(&bytes);
    let body = serde_json::to_string_pretty(&m).unwrap();
    let rest = body.strip_prefix("{\n").unwrap();
    let assemble = |crc: &str| format!("{{\n  \"manifest_crc32c\": \"{crc}\",\n{rest}\n");
    let crc = crc32c::crc32c(assemble("00000000").as_bytes());
    fs::write(&path, assemble(&format!("{crc:08x}"))).unwrap();
}

#[test]
fn consistent_but_wrong_shards_are_corrupt_naming_the_file() {
    // Another step counter in rank 1's file: a rank reading files 0 and 1
    // (the single rank of a 1-rank plan reads all) sees the disagreement.
    let (_tmp, dir, p) = saved4();
    rewrite_shard(&dir, 1, |t| t.get_mut("bucket.00002.step").unwrap().2 = 99u64.to_le_bytes().to_vec());
    assert!(load_checkpoint(&dir).is_err(), "the reference catches it too");
    let one = plan(&registry(&small_model()), (1, 1, 1, 1, 1));
    let reader = CheckpointReader::open(&dir).unwrap();
    for e in [reader.shard_for(&one, 0).unwrap_err(), reader.verify().unwrap_err()] {
        let text = e.to_string();
        assert!(matches!(e, PartitionError::Corrupt { .. }), "{e}");
        assert!(text.contains(&shard_file_name(1, 4)) && text.contains("step counter"), "{text}");
    }

    // A missing tensor, a mistyped one, an unlisted extra.
    type Edit = fn(&mut Tensors);
    let edits: [(&str, Edit); 3] = [
        ("is missing", |t| drop(t.remove("bucket.00001.exp_avg"))),
        ("expected F32", |t| t.get_mut("bucket.00000.master").unwrap().0 = Dtype::I32),
        ("not listed", |t| drop(t.insert("extra/stray".into(), (Dtype::F32, vec![1], vec![0; 4])))),
    ];
    for (want, edit) in edits {
        let (_tmp, dir, p2) = saved4();
        rewrite_shard(&dir, 2, edit);
        assert!(load_checkpoint(&dir).is_err(), "the reference catches {want:?} too");
        all_paths_fail(&dir, &p2, 2, &shard_path(&dir, 2), |e| {
            assert!(matches!(e, PartitionError::Corrupt { .. }) && e.to_string().contains(want), "{e}")
        });
    }
    drop(p);
}

// ------------------------------------------------------------ random combos

fn cfg() -> impl Strategy<Value = Cfg> {
    (
        1usize..4,
        1usize..5,
        1usize..6,
        any::<prop::sample::Index>(),
        prop::sample::select(vec![1usize, 1, 4, 8]),
    )
        .prop_map(|(nodes, local, align, pick, param_align)| {
            let divisors: Vec<usize> = (1..=local).filter(|d| local % d == 0).collect();
            (nodes * local, local, align, divisors[pick.index(divisors.len())], param_align)
        })
}

fn model() -> impl Strategy<Value = Vec<Vec<Param>>> {
    let dtype = prop::sample::select(vec![DType::F32, DType::BF16, DType::F16]);
    let shape = prop::collection::vec(1usize..9, 1..3);
    prop::collection::vec(prop::collection::vec((shape, dtype), 1..4), 1..4)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Any (old W, new W, local size, hpZ, align, param_align) and model:
    /// every new rank's state and the export equal the consolidating path's.
    #[test]
    fn streaming_equals_consolidating(params in model(), from in cfg(), to in cfg(), extras in any::<bool>()) {
        check_reshard(&params, from, to, extras);
    }
}

// ------------------------------------------------------------ peak memory

/// A model of 0.92 M parameters (3.7 MB of f32 master weights) in 4 buckets of
/// unequal sizes, with bf16 parameters for the export's conversion.
fn big_model() -> Vec<Vec<Param>> {
    vec![
        vec![(vec![512, 256], DType::BF16), (vec![256], DType::F32)],
        vec![(vec![384, 512], DType::F32), (vec![512], DType::F32)],
        vec![(vec![512, 512], DType::F16)],
        vec![(vec![640, 512], DType::F32), (vec![7], DType::F32), (vec![1023], DType::BF16)],
    ]
}

/// Heap bytes of one rank's state under `p`: master and two moments of its
/// shard of every bucket.
fn share_bytes(p: &PartitionPlan) -> usize {
    (0..p.num_buckets()).map(|b| 3 * 4 * p.shard_len(b).unwrap()).sum()
}

/// Heap bytes of the largest bucket's f32 values (padding included).
fn bucket_bytes(p: &PartitionPlan) -> usize {
    p.buckets().iter().map(|b| 4 * b.padded_len).max().unwrap()
}

/// Allowance for the O(chunk) buffers (read buffer, buffered reader and
/// writer: 3 × [`CHUNK_BYTES`]) and small bookkeeping (manifest, headers,
/// plans, copy lists): the "+ O(chunk)" of the bound.
const SLACK: usize = 4 * CHUNK_BYTES + 256 * 1024;

/// Peak heap during a resume, a re-shard and an export of a 0.92 M-parameter
/// checkpoint saved on 8 ranks, against the bound "one rank's share + one
/// bucket + O(chunk)"; and the consolidating path (the negative control),
/// which must exceed it, so this test can fail.
#[test]
fn peak_memory_stays_within_one_share_plus_one_bucket() {
    let reg = registry(&big_model());
    let from = (8, 4, 4, 2, 1);
    let saved = plan(&reg, from);
    let tmp = tempfile::tempdir().unwrap();
    let shards = states(&saved, 3, false);
    save_checkpoint(tmp.path(), &saved, 5, &shards, serde_json::json!({})).unwrap();
    drop(shards);
    let model_bytes = 4 * saved.numel();
    assert!(model_bytes >= 3 << 20, "the model must be big enough for the bound to mean something");

    // Resume on the same 8 ranks, re-shard onto 3 (other alignment) and 16.
    for to in [from, (3, 3, 2, 3, 1), (16, 4, 2, 4, 8)] {
        let new = plan(&reg, to);
        let rank = new.world() / 2;
        let bound = share_bytes(&new) + bucket_bytes(&new) + SLACK;
        let (state, peak) = peak_during(|| {
            let reader = CheckpointReader::open(tmp.path()).unwrap();
            reader.shard_for(&new, rank).unwrap()
        });
        let (reference, old_peak) =
            peak_during(|| load_checkpoint(tmp.path()).unwrap().shard_for(&new, rank).unwrap());
        assert_eq!(bits(&state), bits(&reference));
        println!(
            "checkpoint peak {from:?} -> {to:?} rank {rank}: streaming {peak} B = {:.3} x share, {:.3} x (share + bucket); \
             consolidating {old_peak} B = {:.2} x (share + bucket + slack) [bound {bound} B, model {model_bytes} B]",
            peak as f64 / share_bytes(&new) as f64,
            peak as f64 / (share_bytes(&new) + bucket_bytes(&new)) as f64,
            old_peak as f64 / bound as f64,
        );
        assert!(peak <= bound, "streaming peak {peak} B above the bound {bound} B");
        assert!(
            old_peak > bound,
            "negative control: the consolidating path ({old_peak} B) is within {bound} B"
        );
    }

    // Every rank at once (the thread backend's resume): all shares + one bucket.
    let ranks: Vec<usize> = (0..saved.world()).collect();
    let bound = ranks.len() * share_bytes(&saved) + bucket_bytes(&saved) + SLACK;
    let (all, peak) =
        peak_during(|| CheckpointReader::open(tmp.path()).unwrap().shards_for(&saved, &ranks).unwrap());
    println!(
        "checkpoint peak, all {} ranks at once: streaming {peak} B = {:.3} x (sum of shares) [bound {bound} B]",
        ranks.len(),
        peak as f64 / (ranks.len() * share_bytes(&saved)) as f64,
    );
    assert!(peak <= bound, "streaming peak of all ranks {peak} B above the bound {bound} B");
    drop(all);

    // Export: one bucket + O(chunk) (the streamed export holds less: chunks).
    let bound = bucket_bytes(&saved) + SLACK;
    let out = tmp.path().join("model.safetensors");
    let (size, peak) =
        peak_during(|| CheckpointReader::open(tmp.path()).unwrap().export_safetensors(&out).unwrap());
    let old_out = tmp.path().join("old.safetensors");
    let (old_size, old_peak) =
        peak_during(|| load_checkpoint(tmp.path()).unwrap().export_safetensors(&old_out).unwrap());
    assert_eq!(size, old_size);
    assert_same_export(&fs::read(&old_out).unwrap(), &fs::read(&out).unwrap());
    println!(
        "checkpoint export peak: streaming {peak} B = {:.3} x bucket; consolidating {old_peak} B = {:.2} x (bucket + slack) \
         [bound {bound} B, model {model_bytes} B, file {size} B]",
        peak as f64 / bucket_bytes(&saved) as f64,
        old_peak as f64 / bound as f64,
    );
    assert!(peak <= bound, "streaming export peak {peak} B above the bound {bound} B");
    assert!(
        old_peak > bound,
        "negative control: the consolidating export ({old_peak} B) is within {bound} B"
    );
}
