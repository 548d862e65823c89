//! The ring reduce-scatter that requantizes at every hop: the error baseline qgZ
//! is compared with (each hop quantizes a growing partial sum, so errors compound
//! over `g-1` hops instead of two).

use zeropp_quant::{Options, QuantSpec, QuantizedRef, dequantize_into, encoded_len, quantize_to_wire};

use super::{QuantClock, Reduce, check_shard, finish_shard, my_index, with_part};
use crate::{CommError, Communicator, Group};

/// Options of [`ring_quantized_reduce_scatter`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingOptions {
    /// Format of every hop (default: the qgZ default, symmetric INT4).
    pub spec: QuantSpec,
    /// Sum or mean (default mean).
    pub reduce: Reduce,
    /// Kernel options.
    pub quant: Options,
}

impl Default for RingOptions {
    fn default() -> Self {
        let q = super::QgzOptions::default();
        Self { spec: q.inter_spec, reduce: Reduce::Mean, quant: q.quant }
    }
}

/// Ring reduce-scatter on `group`, quantizing at every hop: in step `t = 0..g-1`
/// member `i` quantizes its running partial of part `(i-t-1) mod g` and sends it
/// to member `i+1`, which dequantizes it and adds its own part. Member `i` ends
/// with part `i` (`⌈n/g⌉` elements, padding zeroed) of the sum or mean. Each step
/// is an all-to-all-v carrying `E(spec, s)` bytes to the next member and empty
/// messages to the others.
pub fn ring_quantized_reduce_scatter<C: Communicator + ?Sized>(
    comm: &mut C,
    group: &Group,
    full: &[f32],
    shard: &mut [f32],
    opts: &RingOptions,
) -> Result<(), CommError> {
    let g = group.size();
    let n = full.len();
    let s = check_shard("ring_quantized_reduce_scatter", n, g, shard.len())?;
    let me = my_index(comm, group)?;
    if g == 1 {
        with_part(full, s, 0, |x| shard.copy_from_slice(x))?;
        return Ok(());
    }
    let e = encoded_len(opts.spec, s);
    let (next, prev) = ((me + 1) % g, (me + g - 1) % g);
    let mut send_counts = vec![0usize; g];
    let mut recv_counts = vec![0usize; g];
    send_counts[next] = e;
    recv_counts[prev] = e;
    let mut acc = vec![0.0f32; s];
    with_part(full, s, (me + g - 1) % g, |x| acc.copy_from_slice(x))?;
    let mut send = vec![0u8; e];
    let mut recv = vec![0u8; e];
    for t in 0..g - 1 {
        let clock = QuantClock::start();
        quantize_to_wire(&acc, opts.spec, &opts.quant, &mut send)?;
        clock.stop(comm);
        comm.all_to_all_v_bytes(group, &send, &send_counts, &mut recv, &recv_counts)?;
        let got = QuantizedRef::from_bytes(&recv)?;
        if got.len() != s {
            return Err(CommError::Mismatch(format!("ring: received {} elements, expected {s}", got.len())));
        }
        let clock = QuantClock::start();
        dequantize_into(&got, &mut acc, &opts.quant)?;
        clock.stop(comm);
        let part = (me + 2 * g - t - 2) % g;
        with_part(full, s, part, |x| acc.iter_mut().zip(x).for_each(|(a, b)| *a += b))?;
    }
    shard.copy_from_slice(&acc);
    finish_shard(shard, n, g, me, opts.reduce, g);
    Ok(())
}
