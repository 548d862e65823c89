//! qwZ: the quantized weight all-gather.

use zeropp_quant::{
    Element, Options, QuantSpec, QuantizedRef, dequantize_into, encoded_len, quantize_to_wire,
};

use super::{QuantClock, my_index};
use crate::{CommError, Communicator, Group, LinkBytes, Topology, slices};

/// Bytes `rank` sends in a [`qwz_all_gather`] on `group` of a shard of
/// `shard_len` elements: one encoding of `E(spec, shard_len)` bytes
/// ([`encoded_len`]) to each other member.
///
/// ```
/// use zeropp_comm::collectives::{QwzOptions, group_qwz_bytes};
/// use zeropp_comm::{Group, LinkBytes, Topology};
/// let t = Topology::ranks(8).per_node(4)?;
/// let e = zeropp_comm::quant::encoded_len(QwzOptions::default().spec, 1000) as u64;
/// let b = group_qwz_bytes(&t, 5, &Group::rail(&t, 5), QwzOptions::default().spec, 1000);
/// assert_eq!(b, LinkBytes { intra: 0, inter: e });
/// # Ok::<(), zeropp_comm::CommError>(())
/// ```
pub fn group_qwz_bytes(
    topology: &Topology,
    rank: usize,
    group: &Group,
    spec: QuantSpec,
    shard_len: usize,
) -> LinkBytes {
    LinkBytes::to_members(topology, rank, group, encoded_len(spec, shard_len) as u64)
}

/// Options of [`qwz_all_gather`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QwzOptions {
    /// The quantization format of the shards on the wire (default: symmetric INT8,
    /// groups of [`QwzOptions::DEFAULT_GROUP_SIZE`]).
    pub spec: QuantSpec,
    /// Kernel options (rounding, threading).
    pub quant: Options,
}

impl QwzOptions {
    /// The default quantization group size of qwZ: [`super::DEFAULT_GROUP_SIZE`]
    /// (256, as for qgZ and the engine).
    pub const DEFAULT_GROUP_SIZE: usize = super::DEFAULT_GROUP_SIZE;

    /// Options with another spec.
    pub fn with_spec(spec: QuantSpec) -> Self {
        Self { spec, quant: Options::default() }
    }
}

impl Default for QwzOptions {
    fn default() -> Self {
        // Symmetric INT8 with a non-zero group size is always a valid spec.
        let spec = QuantSpec::int8(Self::DEFAULT_GROUP_SIZE)
            .unwrap_or_else(|_| unreachable!("a non-zero group size is valid"));
        Self { spec, quant: Options::default() }
    }
}

/// qwZ all-gather: quantizes the local shard (f32, bf16 or f16), all-gathers the
/// wire encodings (data, scales and header in ONE message per peer:
/// `E(spec, shard.len())` bytes to each other member) and dequantizes every
/// member's shard into `full` (f32, bf16 or f16; `full.len() == shard.len() · g`).
///
/// Every member's shard, the caller's own included, is dequantized from the same
/// bytes, so all members end up with bit-identical `full` buffers.
///
/// ```
/// use zeropp_comm::collectives::{QwzOptions, qwz_all_gather};
/// use zeropp_comm::{Group, ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
/// let fulls = cluster.run(|comm| {
///     let world = Group::world(comm.topology());
///     let shard: Vec<f32> = (0..100).map(|i| (comm.rank() * 100 + i) as f32 / 400.0).collect();
///     let mut full = vec![0.0f32; 400];
///     qwz_all_gather(comm, &world, &shard, &mut full, &QwzOptions::default())?;
///     Ok::<_, zeropp_comm::CommError>(full)
/// })?;
/// for (i, x) in fulls[0].iter().enumerate() {
///     assert!((x - i as f32 / 400.0).abs() <= 1.0 / 128.0); // INT8: one step of amax/128
/// }
/// assert!(fulls.iter().all(|f| f == &fulls[0]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn qwz_all_gather<C, I, O>(
    comm: &mut C,
    group: &Group,
    shard: &[I],
    full: &mut [O],
    opts: &QwzOptions,
) -> Result<(), CommError>
where
    C: Communicator + ?Sized,
    I: Element,
    O: Element,
{
    let g = group.size();
    let c = shard.len();
    if full.len() != c * g {
        return Err(CommError::Mismatch(format!(
            "qwz_all_gather: output of {} elements for {g} shards of {c}",
            full.len()
        )));
    }
    my_index(comm, group)?;
    let e = encoded_len(opts.spec, c);
    let mut send = vec![0u8; e];
    let clock = QuantClock::start();
    quantize_to_wire(shard, opts.spec, &opts.quant, &mut send)?;
    clock.stop(comm);
    let mut gathered = vec![0u8; e * g];
    comm.all_gather_bytes(group, &send, &mut gathered)?;
    drop(send);
    let clock = QuantClock::start();
    for j in 0..g {
        let q =
            QuantizedRef::from_bytes(slices::chunk(&gathered, j, e, "qwz_all_gather: gathered encodings")?)?;
        if q.len() != c {
            return Err(CommError::Mismatch(format!(
                "qwz_all_gather: member {j} sent a shard of {} elements, expected {c}",
                q.len()
            )));
        }
        let out = slices::window_mut(full, j * c, c, "qwz_all_gather: output")?;
        dequantize_into(&q, out, &opts.quant)?;
    }
    clock.stop(comm);
    Ok(())
}
