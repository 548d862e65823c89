//! Streaming reads of a checkpoint: re-sharding one rank at a time without
//! consolidating the model.
//!
//! [`CheckpointReader::shard_for`] works out which element ranges of which
//! saved shard files the new rank's shard covers, then reads each of those
//! files once, front to back, through a running crc32c: it parses and checks
//! the header, copies the overlapping ranges straight into the new
//! [`ShardState`] as they stream past, skips the rest, and compares the
//! file's size and crc32c with the manifest at the end. The manifest records
//! one crc32c per file, so a file is verified whole even when only part of it
//! is kept; what is held at any time is the rank's own new share plus two
//! [`CHUNK_BYTES`] buffers (the buffered reader's and the copy buffer), the
//! parsed headers and the list of ranges to copy.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use zeropp_comm::Topology;

use super::MANIFEST_FILE;
use super::format::{VALUE_TENSORS, extra_tensor_name, tensor_name};
use super::fs::{read_file, resolve_checkpoint_dir};
use super::manifest::{Manifest, ShardRecord};
use super::shard_file::{CHUNK_BYTES, ShardHeader, finish, open_pass, put_f32, read_chunks, read_header};
use super::state::{BucketShard, ShardState};
use crate::error::{PartitionError, Result};
use crate::layout::ParamRegistry;
use crate::plan::{PartitionPlan, PlanConfig};

/// A verified checkpoint opened for streaming: the manifest is read and
/// checked, the shard files are read only when a rank's state or an export
/// needs them. Unlike [`load_checkpoint`](super::load_checkpoint), nothing is
/// consolidated: [`CheckpointReader::shard_for`] holds one rank's new share
/// plus a [`CHUNK_BYTES`] buffer, [`CheckpointReader::export_safetensors`]
/// a few buffers of that size.
///
/// ```
/// use zeropp_comm::Topology;
/// use zeropp_partition::*;
///
/// let mut reg = ParamRegistry::new();
/// reg.push_bucket("layer0", vec![ParamSpec::new("w", [3, 5], DType::F32)])?;
/// let weights: Vec<f32> = (0..15).map(|i| i as f32 * 0.5).collect();
/// let plan4 = PartitionPlan::new(&reg, Topology::ranks(4).per_node(2)?, PlanConfig::new(2, 2))?;
/// let shards = (0..4)
///     .map(|r| ShardState::from_full_master(&plan4, r, &[&weights]))
///     .collect::<Result<Vec<_>, _>>()?;
/// let dir = std::env::temp_dir().join(format!("zeropp-doc-stream-{}", std::process::id()));
/// save_checkpoint(&dir, &plan4, 7, &shards, serde_json::json!({}))?;
///
/// // Rank 1 of 3 reads only what it needs.
/// let reader = CheckpointReader::open(&dir)?;
/// assert_eq!(reader.step(), 7);
/// let plan3 = reader.plan_for(Topology::ranks(3).per_node(3)?, PlanConfig::default())?;
/// let s1 = reader.shard_for(&plan3, 1)?;
/// assert_eq!(s1.buckets[0].master, weights[5..10]);
/// # std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), PartitionError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointReader {
    dir: PathBuf,
    manifest: Manifest,
    /// The plan the checkpoint was saved with.
    saved: PartitionPlan,
}

/// Where a copied range of a shard file lands.
#[derive(Debug, Clone)]
enum Dst {
    /// Element `at` onwards of value tensor `which` (see [`VALUE_TENSORS`]) of
    /// bucket `bucket` of new state `state` (an index into the batch).
    Values { state: usize, bucket: usize, which: usize, at: usize },
    /// The step counter of bucket `bucket` as this file records it.
    Step { bucket: usize },
    /// The rank-local extra `name` of new state `state`, whole.
    Extra { state: usize, name: String },
}

/// A range of one tensor of a shard file to copy: `count` elements from
/// element `elem` of `tensor`.
#[derive(Debug, Clone)]
struct Op {
    tensor: String,
    elem: usize,
    count: usize,
    dst: Dst,
}

impl CheckpointReader {
    /// Opens the checkpoint in `dir` (a checkpoint folder or a parent folder
    /// whose `LATEST` names one): reads and verifies the manifest (its own
    /// checksum and structure). The shard files are verified when read.
    pub fn open(dir: &Path) -> Result<Self> {
        let step_dir = resolve_checkpoint_dir(dir)?;
        let manifest_path = step_dir.join(MANIFEST_FILE);
        let manifest = Manifest::from_file_bytes(&manifest_path, &read_file(&manifest_path)?)?;
        let saved = manifest.validate(&manifest_path)?;
        Ok(Self { dir: step_dir, manifest, saved })
    }

    /// The checkpoint folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The verified manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Training step.
    pub fn step(&self) -> u64 {
        self.manifest.step
    }

    /// The user config saved with the checkpoint.
    pub fn user_config(&self) -> &serde_json::Value {
        &self.manifest.user_config
    }

    /// The plan the checkpoint was saved with.
    pub fn saved_plan(&self) -> &PartitionPlan {
        &self.saved
    }

    /// The registry of the saved model.
    pub fn registry(&self) -> Result<ParamRegistry> {
        self.manifest.registry()
    }

    /// A plan for the saved model on a new topology and config.
    pub fn plan_for(&self, topology: Topology, config: PlanConfig) -> Result<PartitionPlan> {
        PartitionPlan::new(&self.registry()?, topology, config)
    }

    /// Whether any rank saved extras (from the manifest's listing).
    pub fn has_extras(&self) -> bool {
        self.manifest.lists_extras()
    }

    /// Whether [`CheckpointReader::shard_for`] under `plan` leaves saved
    /// extras out; the same answer as
    /// [`Checkpoint::extras_dropped`](super::Checkpoint::extras_dropped).
    pub fn extras_dropped(&self, plan: &PartitionPlan) -> bool {
        self.has_extras() && !self.manifest.same_partitioning(plan)
    }

    /// Path of saved rank `rank`'s shard file.
    fn shard_path(&self, rec: &ShardRecord) -> PathBuf {
        self.dir.join(&rec.file)
    }

    /// The state of `rank` under `plan`, equal to what
    /// [`Checkpoint::shard_for`](super::Checkpoint::shard_for) cuts from the
    /// consolidated checkpoint (any topology, alignment or hpZ size; padding
    /// zero; extras only under the saved partitioning), read shard by shard.
    ///
    /// Reads only the saved shard files whose shards overlap the new one
    /// (and, if none does, rank 0's file for the step counters), each once,
    /// verifying its size, crc32c and header on the way; keeps only the
    /// overlapping ranges. Peak memory: the returned state plus two
    /// [`CHUNK_BYTES`] buffers and the headers. The step counters of the
    /// files read must agree.
    pub fn shard_for(&self, plan: &PartitionPlan, rank: usize) -> Result<ShardState> {
        let mut states = self.shards_for(plan, &[rank])?;
        states.pop().ok_or_else(|| PartitionError::RankOutOfRange { rank, world: plan.world() })
    }

    /// The states of several ranks under `plan` (in the order of `ranks`),
    /// each equal to [`CheckpointReader::shard_for`]'s, reading every saved
    /// shard file that overlaps any of them once: for a process that holds
    /// several ranks (the thread backend). Peak memory: the returned states
    /// plus two [`CHUNK_BYTES`] buffers and the headers. `ranks` must be
    /// distinct.
    pub fn shards_for(&self, plan: &PartitionPlan, ranks: &[usize]) -> Result<Vec<ShardState>> {
        self.manifest.check_same_model(plan)?;
        if let Some(r) = ranks.iter().enumerate().find_map(|(i, r)| ranks.get(..i)?.contains(r).then_some(r))
        {
            return Err(PartitionError::InvalidConfig(format!("rank {r} is asked for twice")));
        }
        let saved = &self.saved;
        let mut ops: Vec<Vec<Op>> = vec![Vec::new(); saved.world()];
        let mut states = Vec::with_capacity(ranks.len());
        let same = self.manifest.same_partitioning(plan);
        for (state, &rank) in ranks.iter().enumerate() {
            plan.check_rank(rank)?;
            let mut buckets = Vec::with_capacity(plan.num_buckets());
            for b in 0..plan.num_buckets() {
                let n = plan.shard_len(b)?;
                buckets.push(BucketShard {
                    master: vec![0.0; n],
                    exp_avg: vec![0.0; n],
                    exp_avg_sq: vec![0.0; n],
                    step: 0,
                });
                self.plan_copies(plan, rank, b, state, &mut ops)?;
            }
            let mut extra = BTreeMap::new();
            if same {
                for (name, &len) in self.manifest.extras_of(rank) {
                    if let Some(file) = ops.get_mut(rank) {
                        file.push(Op {
                            tensor: extra_tensor_name(name),
                            elem: 0,
                            count: len,
                            dst: Dst::Extra { state, name: name.clone() },
                        });
                    }
                    extra.insert(name.clone(), vec![0.0; len]);
                }
            }
            states.push(ShardState { buckets, extra });
        }
        let mut files: Vec<usize> =
            (0..ops.len()).filter(|&s| ops.get(s).is_some_and(|o| !o.is_empty())).collect();
        if files.is_empty() {
            files.push(0);
        }
        let mut steps: Option<(usize, Vec<u64>)> = None;
        for s in files {
            let mut file_ops = std::mem::take(&mut ops[s]);
            file_ops.extend(self.step_ops());
            let mut file_steps = vec![0u64; saved.num_buckets()];
            self.stream_file(s, file_ops, &mut states, &mut file_steps)?;
            self.agree_steps(&mut steps, s, file_steps)?;
        }
        if let Some((_, steps)) = steps {
            for state in &mut states {
                for (bucket, &step) in state.buckets.iter_mut().zip(&steps) {
                    bucket.step = step;
                }
            }
        }
        Ok(states)
    }

    /// Adds to `ops` (one list per saved shard file) the copies that fill
    /// bucket `b` of `rank`'s new shard (state `state` of the batch): each
    /// parameter piece of the new shard, placed in the saved flat layout and
    /// cut at the saved shard boundaries.
    fn plan_copies(
        &self,
        plan: &PartitionPlan,
        rank: usize,
        b: usize,
        state: usize,
        ops: &mut [Vec<Op>],
    ) -> Result<()> {
        let len_s = self.saved.shard_len(b)?;
        let layout_s = self.saved.bucket(b)?;
        for piece in plan.shard_pieces(rank, b)? {
            let offset_s = layout_s.params.get(piece.param).map(|p| p.offset).ok_or_else(|| {
                PartitionError::LayoutMismatch(format!("bucket {b} has no parameter {}", piece.param))
            })?;
            let (mut x, end) = (offset_s + piece.in_param.start, offset_s + piece.in_param.end);
            let mut at = piece.in_shard.start;
            while x < end && len_s > 0 {
                let s = x / len_s;
                let stop = end.min((s + 1) * len_s);
                let file = ops.get_mut(s).ok_or_else(|| {
                    PartitionError::LayoutMismatch(format!(
                        "element {x} of bucket {b} is past the saved shards"
                    ))
                })?;
                for (which, what) in VALUE_TENSORS.iter().enumerate() {
                    file.push(Op {
                        tensor: tensor_name(b, what),
                        elem: x - s * len_s,
                        count: stop - x,
                        dst: Dst::Values { state, bucket: b, which, at },
                    });
                }
                at += stop - x;
                x = stop;
            }
        }
        Ok(())
    }

    /// Reads of every bucket's step counter.
    fn step_ops(&self) -> impl Iterator<Item = Op> {
        (0..self.saved.num_buckets()).map(|b| Op {
            tensor: tensor_name(b, "step"),
            elem: 0,
            count: 1,
            dst: Dst::Step { bucket: b },
        })
    }

    /// Keeps the step counters of the first file read (`first`) and checks
    /// that file `s`'s are the same.
    fn agree_steps(&self, first: &mut Option<(usize, Vec<u64>)>, s: usize, steps: Vec<u64>) -> Result<()> {
        match first {
            None => *first = Some((s, steps)),
            Some((s0, expected)) => {
                if let Some(b) = (0..expected.len()).find(|&b| expected.get(b) != steps.get(b)) {
                    let path = self.shard_path(&self.manifest.shards[s]);
                    let at = |v: &[u64]| v.get(b).map_or_else(|| "none".to_string(), u64::to_string);
                    return Err(PartitionError::corrupt(
                        path,
                        format!(
                            "bucket {b} step counter {} differs from rank {s0}'s {}",
                            at(&steps),
                            at(expected)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// One verified pass over saved shard file `s`: checks the header,
    /// copies the ranges of `ops` into the state being built, checks size
    /// and crc32c.
    fn stream_file(
        &self,
        s: usize,
        ops: Vec<Op>,
        states: &mut [ShardState],
        steps: &mut [u64],
    ) -> Result<ShardHeader> {
        let rec =
            self.manifest.shards.get(s).ok_or_else(|| {
                PartitionError::InvalidConfig(format!("no shard record for saved rank {s}"))
            })?;
        let path = self.shard_path(rec);
        let mut r = open_pass(&path, rec)?;
        let outcome = (|| {
            let header = read_header(&mut r, &path, rec, &self.manifest, &self.saved)?;
            let mut resolved = ops
                .into_iter()
                .map(|op| {
                    let size = if matches!(op.dst, Dst::Step { .. }) { 8 } else { 4 };
                    let (from, len) = header.byte_range(&path, &op.tensor, op.elem, op.count, size)?;
                    Ok((from, len, op.dst))
                })
                .collect::<Result<Vec<_>>>()?;
            resolved.sort_by_key(|(from, _, _)| *from);
            let mut buf = vec![0u8; CHUNK_BYTES];
            let io_err =
                |e: io::Error| PartitionError::corrupt(&path, format!("cannot read the tensor data: {e}"));
            for (from, len, dst) in resolved {
                let skip = from.checked_sub(r.bytes).ok_or_else(|| {
                    PartitionError::corrupt(
                        &path,
                        "tensors overlap (the header's data offsets are inconsistent)",
                    )
                })?;
                io::copy(&mut (&mut r).take(skip), &mut io::sink()).map_err(io_err)?;
                match dst {
                    Dst::Values { state, bucket, which, at } => {
                        let shard = states
                            .get_mut(state)
                            .and_then(|s| s.buckets.get_mut(bucket))
                            .ok_or_else(|| {
                                PartitionError::LayoutMismatch(format!(
                                    "no bucket {bucket} in new state {state}"
                                ))
                            })?;
                        let v = match which {
                            0 => &mut shard.master,
                            1 => &mut shard.exp_avg,
                            _ => &mut shard.exp_avg_sq,
                        };
                        let mut at = at;
                        read_chunks(&mut r, len, &mut buf, |piece| {
                            if let Some(d) = v.get_mut(at..at + piece.len() / 4) {
                                put_f32(d, piece);
                            }
                            at += piece.len() / 4;
                        })
                        .map_err(io_err)?;
                    }
                    Dst::Step { bucket } => {
                        let mut raw = [0u8; 8];
                        r.read_exact(&mut raw).map_err(io_err)?;
                        if let Some(step) = steps.get_mut(bucket) {
                            *step = u64::from_le_bytes(raw);
                        }
                    }
                    Dst::Extra { state, name } => {
                        let v = states
                            .get_mut(state)
                            .map(|s| s.extra.entry(name).or_default())
                            .ok_or_else(|| PartitionError::LayoutMismatch(format!("no new state {state}")))?;
                        let mut at = 0;
                        read_chunks(&mut r, len, &mut buf, |piece| {
                            if let Some(d) = v.get_mut(at..at + piece.len() / 4) {
                                put_f32(d, piece);
                            }
                            at += piece.len() / 4;
                        })
                        .map_err(io_err)?;
                    }
                }
            }
            Ok(header)
        })();
        finish(&path, rec, r, outcome)
    }

    /// Verifies every shard file (size, crc32c, header, the extras the
    /// manifest lists, step counters equal across ranks) in one streaming
    /// pass each through a [`CHUNK_BYTES`] buffer: what
    /// [`load_checkpoint`](super::load_checkpoint) checks, without
    /// consolidating. Returns the headers, in rank order.
    pub(super) fn verify_all(&self) -> Result<Vec<ShardHeader>> {
        let mut steps = None;
        let mut headers = Vec::with_capacity(self.manifest.shards.len());
        for s in 0..self.manifest.shards.len() {
            let mut file_steps = vec![0u64; self.saved.num_buckets()];
            let header = self.stream_file(s, self.step_ops().collect(), &mut [], &mut file_steps)?;
            self.agree_steps(&mut steps, s, file_steps)?;
            headers.push(header);
        }
        Ok(headers)
    }

    /// Verifies every shard file (size, crc32c, header, listed extras),
    /// streaming each through a [`CHUNK_BYTES`] buffer.
    pub fn verify(&self) -> Result<()> {
        self.verify_all().map(drop)
    }
}
