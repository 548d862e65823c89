//! The device collectives execute the host's own plans, so their results are
//! the host's bit for bit on `HostDevice`: qgZ for any combination of its
//! options (its `Schedule`), the world gathers and reduce-scatters of every
//! routing and wire, and qwZ-Δ's encode, exchange (its `DeltaRoute`) and apply.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use zeropp_comm::collectives::{
    self as host, DeltaOptions, DenseWire, QgzOptions, Reduce, Routing, shard_len,
};
use zeropp_comm::conformance::rank_data;
use zeropp_comm::device::{DeviceBuf, DeviceComm, Elem, HostDevice, collectives as dev};
use zeropp_comm::quant::{QuantSpec, encoded_len};
use zeropp_comm::{CommError, Communicator, TrafficSnapshot};

use crate::device::{SHAPES, bits, device_cluster, qwz_opts, thread_cluster};

/// A non-finite value planted in one rank's gradient: (rank, index, value).
type Plant = Option<(usize, usize, f32)>;

/// Rank `rank`'s gradient of length `n`, with `plant`'s value if it is this rank's.
fn grad_of(rank: usize, n: usize, plant: Plant) -> Vec<f32> {
    let mut g = rank_data(9, rank, n);
    if let Some((r, i, v)) = plant
        && r == rank
        && i < n
    {
        g[i] = v;
    }
    g
}

/// The host collective's shard of one plain qgZ call.
fn host_once(
    comm: &mut zeropp_comm::ThreadComm,
    n: usize,
    opts: &QgzOptions,
    plant: Plant,
) -> Result<Vec<u32>, CommError> {
    let mut out = vec![0f32; shard_len(n, comm.topology().world())];
    host::qgz_reduce_scatter(comm, &grad_of(comm.rank(), n, plant), &mut out, opts)?;
    Ok(canon(&bits(&out)))
}

/// f32 bits with every NaN made the canonical one: which NaN an arithmetic
/// operation returns is the hardware's choice, not the collective's.
fn canon(v: &[u32]) -> Vec<u32> {
    v.iter().map(|&b| if f32::from_bits(b).is_nan() { 0x7FC0_0000 } else { b }).collect()
}

/// The device collective's shard of the same call.
fn device_once(
    comm: &mut DeviceComm<HostDevice>,
    n: usize,
    opts: &QgzOptions,
    plant: Plant,
) -> Result<Vec<u32>, CommError> {
    let d = *comm.device();
    let grad = DeviceBuf::from_f32(&d, comm.stream(), &grad_of(comm.rank(), n, plant))?;
    let out = DeviceBuf::zeroed(&d, 4 * shard_len(n, comm.topology().world()))?;
    dev::qgz_reduce_scatter(comm, grad.view(), out.view(), opts)?;
    Ok(canon(&bits(&out.to_f32(&d, comm.stream())?)))
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

    /// The device qgZ executes the host's schedule: for any shape, length and
    /// combination of qgZ's options (specs per hop, group size, rounding,
    /// rotation, sum or mean) its shards are the host's bit for bit; with a
    /// NaN or ±Inf planted in one rank's gradient under
    /// `NonFinite::Propagate`, the same elements are NaN on both.
    #[test]
    fn device_qgz_is_the_hosts_for_any_options(
        shape in proptest::sample::select(SHAPES.to_vec()),
        n in 0usize..3000,
        gs in proptest::sample::select(vec![8usize, 64, 256]),
        two_level in proptest::bool::ANY,
        hadamard in proptest::option::of(proptest::num::u64::ANY),
        seed in proptest::option::of(proptest::num::u64::ANY),
        sum in proptest::bool::ANY,
        plant in proptest::option::of((
            proptest::prelude::any::<proptest::sample::Index>(),
            proptest::prelude::any::<proptest::sample::Index>(),
            proptest::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY]),
        )),
    ) {
        let mut opts = if two_level { QgzOptions::two_level(gs).unwrap() } else {
            QgzOptions::default().with_spec(QuantSpec::int4(gs).unwrap())
        };
        opts.local_spec = QuantSpec::int8(gs).unwrap();
        if let Some(h) = hadamard {
            opts = opts.with_hadamard(h);
        }
        if let Some(seed) = seed {
            opts.quant = opts.quant.stochastic(seed);
        }
        if sum {
            opts = opts.sum();
        }
        let (w, l) = shape;
        let plant = plant.filter(|_| n > 0).map(|(r, i, v)| (r.index(w), i.index(n), v));
        if plant.is_some() {
            opts.quant = opts.quant.with_non_finite(zeropp_comm::quant::NonFinite::Propagate);
        }
        let host = thread_cluster(w, l).run(|comm| host_once(comm, n, &opts, plant));
        let device = device_cluster(w, l).run(|comm| device_once(comm, n, &opts, plant));
        proptest::prop_assert!(host.is_ok(), "host: {:?}", host.err());
        proptest::prop_assert!(device.is_ok(), "device: {:?}", device.err());
        let (host, device) = (host.unwrap(), device.unwrap());
        if plant.is_some() {
            // The planted value reached its owner (not a vacuous equality).
            proptest::prop_assert!(host.iter().flatten().any(|&b| !f32::from_bits(b).is_finite()));
        }
        proptest::prop_assert_eq!(host, device, "world {} local {} n {} {:?}", w, l, n, opts);
    }
}

/// Every result's bits, and the traffic counters.
type World = (Vec<Vec<u32>>, TrafficSnapshot);

/// The world gather and reduce-scatter of every routing and wire, host side.
fn host_world(comm: &mut zeropp_comm::ThreadComm, n: usize) -> Result<World, CommError> {
    let w = comm.topology().world();
    let (grad, shard) = (rank_data(21, comm.rank(), n), rank_data(22, comm.rank(), n / 5 + 1));
    let mut got = Vec::new();
    for routing in [Routing::Flat, Routing::Hierarchical] {
        for wire in [DenseWire::F32, DenseWire::Bf16] {
            let mut full = vec![0f32; shard.len() * w];
            host::world_all_gather(comm, routing, wire, &shard, &mut full)?;
            got.push(bits(&full));
            if wire == DenseWire::F32 {
                host::world_qwz_all_gather(comm, routing, &shard, &mut full, &qwz_opts())?;
                got.push(bits(&full));
                // Into bf16: the f32 gather rounded to nearest even (the host
                // has no bf16 output here; the call repeats for the traffic).
                host::world_qwz_all_gather(comm, routing, &shard, &mut full, &qwz_opts())?;
                got.push(full.iter().map(|&v| u32::from(half::bf16::from_f32(v).to_bits())).collect());
            }
            for reduce in [Reduce::Mean, Reduce::Sum] {
                let mut out = vec![0f32; shard_len(n, w)];
                host::world_reduce_scatter(comm, routing, wire, &grad, &mut out, reduce)?;
                got.push(bits(&out));
            }
        }
    }
    Ok((got, comm.traffic().snapshot()))
}

/// The same calls on device buffers.
fn device_world(comm: &mut DeviceComm<HostDevice>, n: usize) -> Result<World, CommError> {
    let (d, w) = (*comm.device(), comm.topology().world());
    let grad = DeviceBuf::from_f32(&d, comm.stream(), &rank_data(21, comm.rank(), n))?;
    let c = n / 5 + 1;
    let shard = DeviceBuf::from_f32(&d, comm.stream(), &rank_data(22, comm.rank(), c))?;
    let mut got = Vec::new();
    for routing in [Routing::Flat, Routing::Hierarchical] {
        for wire in [DenseWire::F32, DenseWire::Bf16] {
            let full = DeviceBuf::zeroed(&d, 4 * c * w)?;
            dev::world_all_gather(comm, routing, wire, shard.view(), full.view())?;
            got.push(bits(&full.to_f32(&d, comm.stream())?));
            if wire == DenseWire::F32 {
                dev::world_qwz_all_gather(
                    comm,
                    routing,
                    shard.view(),
                    Elem::F32,
                    full.view(),
                    Elem::F32,
                    &qwz_opts(),
                )?;
                got.push(bits(&full.to_f32(&d, comm.stream())?));
                let full16 = DeviceBuf::zeroed(&d, 2 * c * w)?;
                dev::world_qwz_all_gather(
                    comm,
                    routing,
                    shard.view(),
                    Elem::F32,
                    full16.view(),
                    Elem::Bf16,
                    &qwz_opts(),
                )?;
                let b = full16.to_bytes(&d, comm.stream())?;
                got.push(b.chunks_exact(2).map(|p| u32::from(u16::from_le_bytes([p[0], p[1]]))).collect());
            }
            for reduce in [Reduce::Mean, Reduce::Sum] {
                let out = DeviceBuf::zeroed(&d, 4 * shard_len(n, w))?;
                dev::world_reduce_scatter(comm, routing, wire, grad.view(), out.view(), reduce)?;
                got.push(bits(&out.to_f32(&d, comm.stream())?));
            }
        }
    }
    Ok((got, DeviceComm::traffic(comm).snapshot()))
}

/// The device world collectives (the ZeRO-3 baseline's and qwZ's world gather,
/// flat and hierarchical, f32 and bf16 wires, qwZ into f32 and bf16) give the
/// host's results bit for bit and count the host's traffic.
#[test]
fn device_world_collectives_are_the_hosts_for_every_route() {
    for (w, l) in SHAPES {
        for n in [0, 1, 13, 700, 2048 * w + 5] {
            let host = thread_cluster(w, l).run(|comm| host_world(comm, n)).unwrap();
            let device = device_cluster(w, l).run(|comm| device_world(comm, n)).unwrap();
            for (rank, (h, d)) in host.iter().zip(&device).enumerate() {
                assert_eq!(h, d, "world {w} local {l} n {n} rank {rank}");
            }
        }
    }
}

/// Three difference steps of qwZ-Δ on the host (hpZ groups of `hpz`, shards of
/// `c` weights, copies of type `T`): after each, the bytes of this rank's own
/// reconstruction `ŵ` and of its hpZ copy of the shards it holds; and the traffic.
fn host_delta<T: zeropp_quant::Element + bytemuck::Pod>(
    comm: &mut zeropp_comm::ThreadComm,
    hpz: usize,
    c: usize,
) -> Result<(Vec<Vec<u8>>, TrafficSnapshot), CommError> {
    let opts = DeltaOptions { spec: QuantSpec::int4(64)?, ..DeltaOptions::default() };
    let held = comm.topology().world() / hpz;
    let (mut own, mut copy) = (vec![T::zeroed(); c], vec![T::zeroed(); c * held]);
    let mut enc = vec![0u8; encoded_len(opts.spec, c)];
    let mut out = Vec::new();
    for step in 0..3 {
        host::delta_encode(&rank_data(30 + step, comm.rank(), c), &mut own, &opts, &mut enc)?;
        let got = host::qwz_delta_exchange(comm, hpz, &enc)?;
        for (k, e) in got.chunks(enc.len().max(1)).enumerate() {
            host::delta_apply(&mut copy[k * c..(k + 1) * c], e, &opts)?;
        }
        out.push(bytemuck::cast_slice(&own).to_vec());
        out.push(bytemuck::cast_slice(&copy).to_vec());
    }
    Ok((out, comm.traffic().snapshot()))
}

/// The same steps on device buffers, with copies of type `elem`.
fn device_delta(
    comm: &mut DeviceComm<HostDevice>,
    hpz: usize,
    c: usize,
    elem: Elem,
) -> Result<(Vec<Vec<u8>>, TrafficSnapshot), CommError> {
    let opts = DeltaOptions { spec: QuantSpec::int4(64)?, ..DeltaOptions::default() };
    let (d, held, size) = (*comm.device(), comm.topology().world() / hpz, elem.size());
    let (own, copy) = (DeviceBuf::zeroed(&d, size * c)?, DeviceBuf::zeroed(&d, size * c * held)?);
    let e = encoded_len(opts.spec, c);
    let (enc, got) = (DeviceBuf::zeroed(&d, e)?, DeviceBuf::zeroed(&d, e * held)?);
    let mut out = Vec::new();
    for step in 0..3 {
        let w = DeviceBuf::from_f32(&d, comm.stream(), &rank_data(30 + step, comm.rank(), c))?;
        dev::delta_encode(comm, w.view(), own.view(), elem, &opts, enc.view())?;
        dev::qwz_delta_exchange(comm, hpz, enc.view(), got.view())?;
        for k in 0..held {
            dev::delta_apply(comm, copy.view().chunk(k, size * c)?, elem, got.view().chunk(k, e)?, &opts)?;
        }
        out.push(own.to_bytes(&d, comm.stream())?);
        out.push(copy.to_bytes(&d, comm.stream())?);
    }
    Ok((out, DeviceComm::traffic(comm).snapshot()))
}

/// qwZ-Δ on the device is the host's: over every shape and hpZ group size
/// (one group per node, or several, so hop 2 runs), f32 and bf16 copies,
/// three steps: the owners' reconstructions, the holders' copies (bit for bit)
/// and the traffic.
#[test]
fn device_qwz_delta_is_the_hosts() {
    for (w, l) in SHAPES {
        for hpz in (1..=l).filter(|h| l % h == 0) {
            for c in [1, 100] {
                let device =
                    |elem| device_cluster(w, l).run(|comm| device_delta(comm, hpz, c, elem)).unwrap();
                let host = thread_cluster(w, l).run(|comm| host_delta::<f32>(comm, hpz, c)).unwrap();
                assert_eq!(host, device(Elem::F32), "f32 copies: world {w} local {l} hpz {hpz} c {c}");
                let host = thread_cluster(w, l).run(|comm| host_delta::<half::bf16>(comm, hpz, c)).unwrap();
                assert_eq!(host, device(Elem::Bf16), "bf16 copies: world {w} local {l} hpz {hpz} c {c}");
            }
        }
    }
}
