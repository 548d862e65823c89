//! Names of checkpoint folders, shard files and tensors, and the
//! little-endian f32 encoding of tensor data.

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
