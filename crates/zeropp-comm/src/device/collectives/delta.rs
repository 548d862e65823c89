//! qwZ-Δ on device buffers: the owner's encode, a holder's apply and the
//! exchange of [`crate::collectives::qwz_delta_exchange`], with every byte
//! staying on the device.
//!
//! The exchange executes the host's own route (`DeltaRoute`: who sends to
//! whom in each hop, in which order), and encode and apply take the host's
//! arithmetic step by step (`w − ŵ` as `w + (−ŵ)`, which IEEE defines as the
//! same operation; the sum `deq + ŵ` in f32, then rounded to the copy's type),
//! so on [`HostDevice`](crate::device::HostDevice) the owner's reconstruction,
//! the holders' copies and the traffic are the host's bit for bit (the
//! `device` tests).

use super::{elements, quant};
use crate::collectives::DeltaOptions;
use crate::collectives::qwz_delta::DeltaRoute;
use crate::device::{Device, DeviceBuf, DeviceCommunicator, Elem, Kernel, View};
use crate::quant::encoded_len;
use crate::{CommError, Group};

/// `w_hat` (of type `elem`) widened into the f32 vector `dst`, exactly.
fn widen<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    w_hat: View<'_, C::Device>,
    elem: Elem,
    dst: View<'_, C::Device>,
) -> Result<(), CommError> {
    match elem {
        Elem::F32 => comm.device().copy(comm.stream(), w_hat, dst),
        Elem::Bf16 => comm.device().kernel(comm.stream(), Kernel::FromBf16 { src: w_hat, dst }),
    }
}

/// The owner's half of a difference step on the device: encodes
/// `Q(w − ŵ)` (`w` the shard's new f32 weights, `ŵ` the reconstruction every
/// holder has, of type `elem`) into the first `encoded_len(opts.spec, n)` bytes
/// of `out`, then updates `ŵ` as [`delta_apply`] updates each holder's copy.
/// Returns the bytes written. The device twin of
/// [`crate::collectives::delta_encode`].
pub fn delta_encode<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    w: View<'_, C::Device>,
    w_hat: View<'_, C::Device>,
    elem: Elem,
    opts: &DeltaOptions,
    out: View<'_, C::Device>,
) -> Result<usize, CommError> {
    let n = elements(w, Elem::F32, "qwz delta")?;
    let m = elements(w_hat, elem, "qwz delta")?;
    if n != m {
        return Err(CommError::Mismatch(format!("qwz delta: {n} weights against a reconstruction of {m}")));
    }
    let e = encoded_len(opts.spec, n);
    if out.len() < e {
        return Err(CommError::Mismatch(format!(
            "qwz delta: an output of {} bytes for an encoding of {e}",
            out.len()
        )));
    }
    let (dev, st) = (comm.device(), comm.stream());
    // w − ŵ, as w + (−ŵ): ŵ widened, negated (a division by −1 is exact), w added.
    let diff = DeviceBuf::zeroed(dev, 4 * n)?;
    widen(comm, w_hat, elem, diff.view())?;
    dev.kernel(st, Kernel::Div { buf: diff.view(), by: -1.0 })?;
    dev.kernel(st, Kernel::Add { src: w, elem: Elem::F32, dst: diff.view() })?;
    let enc = out.slice(0, e)?;
    quant(
        comm,
        Kernel::Quantize { src: diff.view(), elem: Elem::F32, spec: opts.spec, opts: opts.quant, dst: enc },
    )?;
    delta_apply(comm, w_hat, elem, enc, opts)?;
    Ok(e)
}

/// A holder's half on the device: `ŵ ← round(ŵ + Deq(q))` for the encoding
/// `enc` (in `opts.spec`) of one shard's difference; the sum is taken in f32
/// and rounded to `elem` (to nearest, ties to even). The device twin of
/// [`crate::collectives::delta_apply`].
pub fn delta_apply<C: DeviceCommunicator + ?Sized>(
    comm: &C,
    w_hat: View<'_, C::Device>,
    elem: Elem,
    enc: View<'_, C::Device>,
    opts: &DeltaOptions,
) -> Result<(), CommError> {
    let n = elements(w_hat, elem, "qwz delta")?;
    let (dev, st) = (comm.device(), comm.stream());
    let sum = DeviceBuf::zeroed(dev, 4 * n)?;
    quant(comm, Kernel::Dequantize { src: enc, spec: opts.spec, len: n, dst: sum.view(), add: false })?;
    dev.kernel(st, Kernel::Add { src: w_hat, elem, dst: sum.view() })?;
    match elem {
        Elem::F32 => dev.copy(st, sum.view(), w_hat),
        Elem::Bf16 => dev.kernel(st, Kernel::ToBf16 { src: sum.view(), dst: w_hat }),
    }
}

/// qwZ-Δ's exchange on device buffers (collective over the world): `delta` is
/// this rank's encoding of its primary shard's difference (the same length `E`
/// on every rank); `out` (`W/H·E` bytes) receives the encodings of the shards
/// this rank holds in its hpZ copy (groups of `hpz` ranks), in shard order. The
/// device twin of [`crate::collectives::qwz_delta_exchange`]: the same route
/// (hop 1 over the world, hop 2 inside the node) and the same bytes.
pub fn qwz_delta_exchange<C: DeviceCommunicator + ?Sized>(
    comm: &mut C,
    hpz: usize,
    delta: View<'_, C::Device>,
    out: View<'_, C::Device>,
) -> Result<(), CommError> {
    let t = *comm.topology();
    let (w, me, e) = (t.world(), comm.rank(), delta.len());
    let route = DeltaRoute::new(&t, hpz, me)?;
    if out.len() != route.holds.len() * e {
        return Err(CommError::Mismatch(format!(
            "qwz delta: an output of {} bytes for {} encodings of {e}",
            out.len(),
            route.holds.len()
        )));
    }
    let dev = comm.device().clone();
    // Hop 1: my encoding to each of its hop-1 targets, in rank order.
    let bytes = |on: &[bool]| -> Vec<usize> { on.iter().map(|&b| if b { e } else { 0 }).collect() };
    let (send_counts, recv_counts) = (bytes(&route.hop1_to), bytes(&route.hop1_from));
    let sends = route.hop1_to.iter().filter(|&&b| b).count();
    let send = DeviceBuf::zeroed(&dev, sends * e)?;
    for k in 0..sends {
        dev.copy(comm.stream(), delta, send.view().chunk(k, e)?)?;
    }
    let recv = DeviceBuf::zeroed(&dev, recv_counts.iter().sum())?;
    comm.all_to_all_v(&Group::world(&t), send.view(), &send_counts, recv.view(), &recv_counts)?;
    drop(send);
    // Where each owner's encoding sits: (from hop 1's buffer, its slot) or hop 2's.
    let mut by_owner: Vec<Option<(bool, usize)>> = vec![None; w];
    for (k, from) in (0..w).filter(|&f| route.hop1_from[f]).enumerate() {
        by_owner[from] = Some((true, k));
    }
    // Hop 2: first-group holders forward other nodes' encodings to the node's other groups.
    let incoming = route.hop2.as_ref().map_or(0, |h2| h2.incoming.len() * e);
    let forwarded = DeviceBuf::zeroed(&dev, incoming)?;
    let slot = |at: Option<(bool, usize)>, owner: usize| -> Result<View<'_, C::Device>, CommError> {
        match at {
            Some((true, k)) => recv.view().chunk(k, e),
            Some((false, k)) => forwarded.view().chunk(k, e),
            None => {
                Err(CommError::Mismatch(format!("qwz delta: rank {me} got no difference of shard {owner}")))
            }
        }
    };
    if let Some(h2) = &route.hop2 {
        let mine = h2.forwards.len() * e;
        let send_counts: Vec<usize> =
            h2.node.ranks().iter().map(|p| if h2.to.contains(p) { mine } else { 0 }).collect();
        let recv_counts: Vec<usize> =
            h2.node.ranks().iter().map(|&p| if Some(p) == h2.source { incoming } else { 0 }).collect();
        let send = DeviceBuf::zeroed(&dev, mine * h2.to.len())?;
        for copy in 0..h2.to.len() {
            for (k, &r) in h2.forwards.iter().enumerate() {
                dev.copy(
                    comm.stream(),
                    slot(by_owner[r], r)?,
                    send.view().chunk(copy * h2.forwards.len() + k, e)?,
                )?;
            }
        }
        comm.all_to_all_v(&h2.node, send.view(), &send_counts, forwarded.view(), &recv_counts)?;
        for (k, &r) in h2.incoming.iter().enumerate() {
            by_owner[r] = Some((false, k));
        }
    }
    for (i, r) in route.holds.enumerate() {
        dev.copy(comm.stream(), slot(by_owner[r], r)?, out.chunk(i, e)?)?;
    }
    Ok(())
}
