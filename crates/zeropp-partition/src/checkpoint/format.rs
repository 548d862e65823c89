//! Names of checkpoint folders, shard files and tensors, and the
//! little-endian f32 encoding of tensor data; checks of the rank-local
//! extras a shard file holds.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::Path;

use safetensors::tensor::Dtype;
use serde::Deserialize;

use crate::error::{PartitionError, Result};

/// Value of the `format` metadata key of every shard file.
pub(super) const SHARD_FORMAT: &str = "zeropp-shard";

/// Name of a checkpoint folder: `step-00000123`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Name of a rank's shard file: `rank-00003-of-00008.safetensors`.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

/// Name of one tensor of a bucket in a shard file: `bucket.00002.exp_avg`.
/// The three f32 tensors of a bucket in a shard file, in the order of
/// [`BucketShard`](super::state::BucketShard)'s fields.
pub(super) const VALUE_TENSORS: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

pub(super) fn tensor_name(bucket: usize, what: &str) -> String {
    format!("bucket.{bucket:05}.{what}")
}

/// Little-endian bytes of an f32 slice (safetensors byte order).
pub(super) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The inverse of [`f32_bytes`] (a trailing partial value is ignored).
pub(super) fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Prefix of the tensor names of rank-local extras in a shard file
/// (`extra/NAME`); bucket tensors start with `bucket.`, so the two never clash.
pub(super) const EXTRA_PREFIX: &str = "extra/";

/// Name of the tensor holding the rank-local extra `name`: `extra/NAME`.
pub(super) fn extra_tensor_name(name: &str) -> String {
    format!("{EXTRA_PREFIX}{name}")
}

/// Checks the name of a rank-local extra: non-empty, without control
/// characters (it becomes part of a tensor name and of error messages).
pub(super) fn check_extra_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() {
        Err("the name of an extra is empty".into())
    } else if name.chars().any(char::is_control) {
        Err(format!("the name of extra {name:?} has control characters"))
    } else {
        Ok(())
    }
}

/// Compares the `extra/…` tensors found in a shard file (name without the
/// prefix → dtype and shape) with the manifest's listing of that rank
/// (name → length). Returns what differs first, or `Ok` if they agree
/// exactly: every listed extra present as f32 of the listed length, and
/// nothing unlisted.
pub(super) fn compare_extras(
    found: &BTreeMap<String, (Dtype, Vec<usize>)>,
    listed: &BTreeMap<String, usize>,
) -> std::result::Result<(), String> {
    for (name, &len) in listed {
        let tensor = extra_tensor_name(name);
        match found.get(name) {
            None => return Err(format!("tensor {tensor} listed in the manifest is missing")),
            Some((dtype, shape)) if *dtype != Dtype::F32 || shape.as_slice() != [len] => {
                return Err(format!(
                    "tensor {tensor} is {dtype:?}{shape:?}, the manifest lists F32[{len}] (truncated or replaced?)"
                ));
            }
            Some(_) => {}
        }
    }
    if let Some(name) = found.keys().find(|n| !listed.contains_key(*n)) {
        return Err(format!(
            "tensor {} is not listed in the manifest (build the manifest with Manifest::with_extras)",
            extra_tensor_name(name)
        ));
    }
    Ok(())
}

/// The `extra/…` entries (name without the prefix → dtype and shape) of a
/// safetensors header, read from the start of the file only: rank 0 checks
/// every shard at commit without reading the tensor data.
pub(super) fn read_header_extras(path: &Path) -> Result<BTreeMap<String, (Dtype, Vec<usize>)>> {
    /// The part of a safetensors header entry this check needs.
    #[derive(Deserialize)]
    struct Entry {
        dtype: Dtype,
        shape: Vec<usize>,
    }
    let bad = |reason: String| PartitionError::corrupt(path, reason);
    let mut f = File::open(path).map_err(|e| PartitionError::io(path, e))?;
    let header = read_header_json(&mut f, path)?;
    let entries: HashMap<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("invalid safetensors header: {e}")))?;
    entries
        .into_iter()
        .filter_map(|(key, value)| key.strip_prefix(EXTRA_PREFIX).map(|name| (name.to_string(), value)))
        .map(|(name, value)| {
            let e: Entry = serde_json::from_value(value)
                .map_err(|e| bad(format!("header entry {}: {e}", extra_tensor_name(&name))))?;
            Ok((name, (e.dtype, e.shape)))
        })
        .collect()
}

/// Largest safetensors header accepted (the limit of the safetensors crate).
pub(super) const MAX_HEADER_BYTES: usize = 100_000_000;

/// Reads the header of a safetensors file from the start of `r`: the
/// little-endian u64 length, then that many bytes (the JSON header, at most
/// [`MAX_HEADER_BYTES`]), which it returns; `path` names the file in errors.
pub(super) fn read_header_json<R: Read>(r: &mut R, path: &Path) -> Result<Vec<u8>> {
    let bad = |reason: String| PartitionError::corrupt(path, reason);
    let mut len = [0u8; 8];
    r.read_exact(&mut len).map_err(|e| bad(format!("cannot read the safetensors header length: {e}")))?;
    let n = usize::try_from(u64::from_le_bytes(len))
        .ok()
        .filter(|&n| n <= MAX_HEADER_BYTES)
        .ok_or_else(|| bad("safetensors header too large".into()))?;
    let mut header = vec![0u8; n];
    r.read_exact(&mut header).map_err(|e| bad(format!("cannot read the safetensors header: {e}")))?;
    Ok(header)
}

/// Checks a shard file's safetensors metadata `info`: the shard format, and
/// the rank, world size and step the manifest says it was saved with.
pub(super) fn check_shard_metadata(
    info: &HashMap<String, String>,
    rank: usize,
    world: usize,
    step: u64,
) -> std::result::Result<(), String> {
    let expect = [
        ("format", SHARD_FORMAT.to_string()),
        ("rank", rank.to_string()),
        ("world", world.to_string()),
        ("step", step.to_string()),
    ];
    for (k, v) in expect {
        if info.get(k) != Some(&v) {
            return Err(format!("metadata {k} is {:?}, expected {v:?}", info.get(k)));
        }
    }
    Ok(())
}
