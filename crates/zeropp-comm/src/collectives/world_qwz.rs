//! qwZ's world gather with a choice of [`Routing`]: every rank's shard
//! quantized once, gathered as encodings over the rail then the node
//! (hierarchical) or over the world (flat), and dequantized into world order.
//! The two-hop gather is `hierarchical.rs`'s, so the routing and its byte
//! formula are written once.

use zeropp_quant::{
    Options, QuantError, QuantSpec, QuantizedRef, dequantize_into, encoded_len, quantize_to_wire,
};

use super::hierarchical::{gather_two_hop, to_world_order, two_hop_gather_bytes};
use super::{QuantClock, QwzOptions, Routing, group_qwz_bytes};
use crate::{CommError, Communicator, Group, LinkBytes, Topology};

/// The wire encodings of every rank's shard over the whole world: the own shard
/// is quantized once (`E = encoded_len(opts.spec, shard.len())` bytes, one wire
/// encoding with header and scales), gathered flat or hierarchically (rail, then
/// node; the bytes are forwarded as they are, never requantized), and returned in
/// world rank order (`W·E` bytes, rank `r`'s encoding at `[r·E, (r+1)·E)`).
/// Dequantize them with [`dequantize_encodings`]. Every rank must pass a shard of
/// the same length. Bytes per rank: [`world_qwz_bytes`].
///
/// ```
/// use zeropp_comm::collectives::{QwzOptions, Routing, dequantize_encodings, world_qwz_gather_encoded};
/// use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
/// let opts = QwzOptions::default();
/// let out = cluster.run(|comm| {
///     let shard = vec![comm.rank() as f32; 8];
///     let enc = world_qwz_gather_encoded(comm, Routing::Hierarchical, &shard, &opts)?;
///     // Keep only ranks 2 and 3 (e.g. a secondary range) and dequantize them.
///     let e = enc.len() / 4;
///     let mut part = vec![0.0f32; 16];
///     dequantize_encodings(&enc[2 * e..], 8, &mut part, &opts.quant)?;
///     Ok::<_, zeropp_comm::CommError>(part)
/// })?;
/// // INT8: within one step (amax/128) of ranks 2 and 3's values.
/// assert!(out[0][..8].iter().all(|x| (x - 2.0).abs() <= 2.0 / 128.0));
/// assert!(out[0][8..].iter().all(|x| (x - 3.0).abs() <= 3.0 / 128.0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn world_qwz_gather_encoded<C: Communicator + ?Sized>(
    comm: &mut C,
    routing: Routing,
    shard: &[f32],
    opts: &QwzOptions,
) -> Result<Vec<u8>, CommError> {
    let topo = *comm.topology();
    let w = topo.world();
    let e = encoded_len(opts.spec, shard.len());
    let total = e
        .checked_mul(w)
        .filter(|_| e != usize::MAX)
        .ok_or(CommError::Quant(QuantError::TooLarge(shard.len() as u64)))?;
    let mut mine = vec![0u8; e];
    let clock = QuantClock::start();
    quantize_to_wire(shard, opts.spec, &opts.quant, &mut mine)?;
    clock.stop(comm);
    let mut out = vec![0u8; total];
    match routing {
        Routing::Flat => comm.all_gather_bytes(&Group::world(&topo), &mine, &mut out)?,
        Routing::Hierarchical => {
            let gathered = gather_two_hop(comm, &topo, mine)?;
            to_world_order("world_qwz_gather_encoded", &topo, &gathered, e, &mut out, |b| b)?;
        }
    }
    Ok(out)
}

/// qwZ all-gather over the whole world: [`world_qwz_gather_encoded`], then every
/// rank's encoding (the own one included) is dequantized into its world position
/// (`full.len() == shard.len() · W`). Both routings give bit-identical results,
/// equal to [`qwz_all_gather`](super::qwz_all_gather) on [`Group::world`]; only the
/// traffic differs ([`world_qwz_bytes`]).
///
/// ```
/// use zeropp_comm::collectives::{QwzOptions, Routing, world_qwz_all_gather};
/// use zeropp_comm::{ThreadCluster, ThreadOptions, Topology};
/// let cluster = ThreadCluster::new(Topology::ranks(4).per_node(2)?, ThreadOptions::default());
/// let fulls = cluster.run(|comm| {
///     let shard: Vec<f32> = (0..100).map(|i| (comm.rank() * 100 + i) as f32 / 400.0).collect();
///     let mut flat = vec![0.0f32; 400];
///     world_qwz_all_gather(comm, Routing::Flat, &shard, &mut flat, &QwzOptions::default())?;
///     let mut hier = vec![0.0f32; 400];
///     world_qwz_all_gather(comm, Routing::Hierarchical, &shard, &mut hier, &QwzOptions::default())?;
///     assert_eq!(flat, hier);
///     Ok::<_, zeropp_comm::CommError>(hier)
/// })?;
/// for (i, x) in fulls[0].iter().enumerate() {
///     assert!((x - i as f32 / 400.0).abs() <= 1.0 / 128.0); // INT8: one step of amax/128
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn world_qwz_all_gather<C: Communicator + ?Sized>(
    comm: &mut C,
    routing: Routing,
    shard: &[f32],
    full: &mut [f32],
    opts: &QwzOptions,
) -> Result<(), CommError> {
    let (w, c) = (comm.topology().world(), shard.len());
    if full.len() != c * w {
        return Err(CommError::Mismatch(format!(
            "world_qwz_all_gather: output of {} elements for {w} shards of {c}",
            full.len()
        )));
    }
    let encodings = world_qwz_gather_encoded(comm, routing, shard, opts)?;
    let clock = QuantClock::start();
    dequantize_encodings(&encodings, c, full, &opts.quant)?;
    clock.stop(comm);
    Ok(())
}

/// Bytes one rank sends in [`world_qwz_all_gather`] / [`world_qwz_gather_encoded`]
/// of a shard of `shard_len` elements, with `E = encoded_len(spec, shard_len)`:
/// flat sends `E` to each other rank (intra `(L-1)·E`, inter `(W-L)·E`);
/// hierarchical sends inter `(N-1)·E` and intra `(L-1)·N·E`.
pub fn world_qwz_bytes(
    topology: &Topology,
    routing: Routing,
    spec: QuantSpec,
    shard_len: usize,
) -> LinkBytes {
    match routing {
        Routing::Flat => group_qwz_bytes(topology, 0, &Group::world(topology), spec, shard_len),
        Routing::Hierarchical => two_hop_gather_bytes(topology, encoded_len(spec, shard_len) as u64),
    }
}

/// Offset of the `payload_len` field (`u64`, little-endian) in a wire header
/// (see [`zeropp_quant::wire`]).
const PAYLOAD_LEN_AT: usize = 20;

/// The first encoding of `rest`: its length as its header declares it, or all of
/// `rest` when the header is truncated or declares more (so that decoding reports
/// the damage).
fn first_encoding(rest: &[u8]) -> &[u8] {
    let declared = rest
        .get(PAYLOAD_LEN_AT..PAYLOAD_LEN_AT + 8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .and_then(|b| usize::try_from(u64::from_le_bytes(b)).ok())
        .and_then(|p| p.checked_add(zeropp_quant::wire::HEADER_LEN));
    match declared {
        Some(len) if len <= rest.len() => rest.split_at(len).0,
        _ => rest,
    }
}

/// Dequantizes `k` consecutive wire encodings of `shard_len` elements each
/// (e.g. part of [`world_qwz_gather_encoded`]'s output) into `full`
/// (`k · shard_len` elements, encoding `j` at `[j·shard_len, (j+1)·shard_len)`).
///
/// Every encoding's header is validated (magic, version, checksum, lengths); an
/// encoding of another length than `shard_len`, or a count of encodings that does
/// not fill `full` exactly, is a [`CommError::Mismatch`]; damaged bytes are a
/// [`CommError::Quant`].
///
/// ```
/// use zeropp_comm::collectives::dequantize_encodings;
/// use zeropp_quant::{Options, QuantSpec, encoded_len, quantize_to_wire};
/// let spec = QuantSpec::int8(4)?;
/// let e = encoded_len(spec, 4);
/// let mut bytes = vec![0u8; 2 * e];
/// quantize_to_wire(&[1.0f32, 2.0, 3.0, 4.0], spec, &Options::default(), &mut bytes[..e])?;
/// quantize_to_wire(&[-1.0f32; 4], spec, &Options::default(), &mut bytes[e..])?;
/// let mut full = [0.0f32; 8];
/// dequantize_encodings(&bytes, 4, &mut full, &Options::default())?;
/// assert!(full[4..].iter().all(|x| (x + 1.0).abs() <= 1.0 / 128.0));
/// assert!(dequantize_encodings(&bytes, 3, &mut [0.0f32; 6], &Options::default()).is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn dequantize_encodings(
    bytes: &[u8],
    shard_len: usize,
    full: &mut [f32],
    opts: &Options,
) -> Result<(), CommError> {
    const WHAT: &str = "dequantize_encodings";
    let total = full.len();
    let mut rest = bytes;
    let mut count = 0usize;
    while !rest.is_empty() {
        let enc = first_encoding(rest);
        rest = rest.split_at(enc.len()).1;
        let q = QuantizedRef::from_bytes(enc)?;
        if q.len() != shard_len {
            return Err(CommError::Mismatch(format!(
                "{WHAT}: encoding {count} holds {} elements, expected {shard_len}",
                q.len()
            )));
        }
        let out = full.get_mut(count * shard_len..(count + 1) * shard_len).ok_or_else(|| {
            CommError::Mismatch(format!(
                "{WHAT}: more than {count} encodings of {shard_len} elements for an output of {total}"
            ))
        })?;
        dequantize_into(&q, out, opts)?;
        count += 1;
    }
    if count * shard_len != total {
        return Err(CommError::Mismatch(format!(
            "{WHAT}: {count} encodings of {shard_len} elements for an output of {total}"
        )));
    }
    Ok(())
}
