//! The one-device simulated cluster on host memory (`HostDevice`): the conformance
//! suite unchanged, the device ZeRO++ collectives bitwise equal to the host ones
//! on the thread backend, the same counters and the same argument errors.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use std::time::Duration;

use half::bf16;
use zeropp_comm::collectives::{self as host, QgzOptions, QwzOptions, Reduce, shard_len};
use zeropp_comm::conformance::{Case, DevicePath, HostPath, rank_data, run_all, run_collectives};
use zeropp_comm::device::{
    Device, DeviceBuf, DeviceCluster, DeviceComm, DeviceCommunicator, Elem, HostDevice, Kernel,
    collectives as dev, collectives::DeviceFeedback,
};
use zeropp_comm::quant::{Options, QuantSpec, Rounding};
use zeropp_comm::{CommError, Communicator, Group, ThreadCluster, ThreadOptions, Topology, TrafficSnapshot};
use zeropp_quant::encoded_len;

pub(crate) const SHAPES: [(usize, usize); 8] =
    [(1, 1), (2, 1), (2, 2), (4, 2), (6, 3), (8, 4), (8, 1), (4, 4)];

fn opts() -> ThreadOptions {
    ThreadOptions::default().with_timeout(Duration::from_secs(20))
}

pub(crate) fn device_cluster(w: usize, l: usize) -> DeviceCluster<HostDevice> {
    DeviceCluster::new(Topology::ranks(w).per_node(l).unwrap(), HostDevice, opts())
}

/// A rank's device and its world group.
fn device_and_world(comm: &DeviceComm<HostDevice>) -> (HostDevice, Group) {
    (*comm.device(), Group::world(comm.topology()))
}

pub(crate) fn thread_cluster(w: usize, l: usize) -> ThreadCluster {
    ThreadCluster::new(Topology::ranks(w).per_node(l).unwrap(), opts())
}

#[test]
fn conformance_suite_runs_unchanged() {
    for (w, l) in SHAPES {
        for len in [0, 1, 5, 97] {
            let case = Case { seed: 42, len };
            let r =
                device_cluster(w, l).run(|comm| run_all(comm, &case)).map(|_| ()).map_err(|e| e.to_string());
            assert_eq!(r, Ok(()), "world {w} local {l} len {len}");
        }
    }
}

/// The device collectives pass the suite's checks of the ZeRO++ collectives
/// unchanged (the same sequential and f64 references the host collectives
/// pass), and send exactly the host collectives' traffic doing so.
#[test]
fn the_device_collectives_pass_the_conformance_suite() {
    for (w, l) in SHAPES {
        for len in [0, 1, 5, 97] {
            let case = Case { seed: 42, len };
            let on_device = device_cluster(w, l)
                .run(|comm| {
                    run_collectives(&mut DevicePath(&mut *comm), &case)
                        .map_err(zeropp_comm::CommError::Mismatch)?;
                    Ok::<_, zeropp_comm::CommError>(DeviceCommunicator::traffic(comm).snapshot())
                })
                .map_err(|e| e.to_string());
            assert!(on_device.is_ok(), "world {w} local {l} len {len}: {on_device:?}");
            let on_threads = thread_cluster(w, l)
                .run(|comm| {
                    run_collectives(&mut HostPath(&mut *comm), &case)
                        .map_err(zeropp_comm::CommError::Mismatch)?;
                    Ok::<_, zeropp_comm::CommError>(comm.traffic().snapshot())
                })
                .map_err(|e| e.to_string());
            assert_eq!(on_device, on_threads, "traffic, world {w} local {l} len {len}");
        }
    }
}

#[test]
fn conformance_counts_the_thread_backends_traffic() {
    for (w, l) in [(4, 2), (6, 3), (8, 1)] {
        let case = Case { seed: 9, len: 31 };
        let on_threads: Vec<TrafficSnapshot> = thread_cluster(w, l)
            .run(|comm| run_all(comm, &case).map(|()| comm.traffic().snapshot()))
            .unwrap();
        let on_device: Vec<TrafficSnapshot> = device_cluster(w, l)
            .run(|comm| run_all(comm, &case).map(|()| Communicator::traffic(comm).snapshot()))
            .unwrap();
        assert_eq!(on_threads, on_device, "world {w} local {l}");
    }
}

/// Everything one rank computes, host side and device side, for one shape.
#[derive(Debug, PartialEq)]
pub(crate) struct Results {
    qwz_f32: Vec<u32>,
    qwz_bf16: Vec<u32>,
    hpz: Vec<u32>,
    hpz_int8: Vec<u32>,
    ag_bf16: Vec<u16>,
    rs_bf16: Vec<u32>,
    qgz: Vec<u32>,
    qgz_sum_stochastic: Vec<u32>,
    qgz_int8_g7: Vec<u32>,
    traffic: TrafficSnapshot,
}

pub(crate) fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn stochastic() -> QgzOptions {
    let mut o = QgzOptions::default().sum();
    o.quant = Options::default().with_rounding(Rounding::Stochastic { seed: 77 });
    o
}

fn int8_g7() -> QgzOptions {
    QgzOptions::default().with_spec(QuantSpec::int8(7).unwrap())
}

pub(crate) fn qwz_opts() -> QwzOptions {
    QwzOptions::with_spec(QuantSpec::int8(32).unwrap())
}

pub(crate) fn on_threads(comm: &mut zeropp_comm::ThreadComm, n: usize) -> Result<Results, CommError> {
    let t = *comm.topology();
    let (w, rank) = (t.world(), comm.rank());
    let world = Group::world(&t);
    let node = Group::intra_node(&t, rank);
    let grad = rank_data(5, rank, n);
    let c = n / 3 + 1;
    let shard = rank_data(11, rank, c);
    let shard16: Vec<bf16> = shard.iter().map(|&x| bf16::from_f32(x)).collect();
    let mut r = Results {
        qwz_f32: vec![],
        qwz_bf16: vec![],
        hpz: vec![],
        hpz_int8: vec![],
        ag_bf16: vec![],
        rs_bf16: vec![],
        qgz: vec![],
        qgz_sum_stochastic: vec![],
        qgz_int8_g7: vec![],
        traffic: TrafficSnapshot::default(),
    };
    let mut full = vec![0f32; c * w];
    comm.traffic_mut().set_op("qwz");
    host::qwz_all_gather(comm, &world, &shard, &mut full, &qwz_opts())?;
    r.qwz_f32 = bits(&full);
    host::qwz_all_gather(comm, &world, &shard16, &mut full, &QwzOptions::default())?;
    r.qwz_bf16 = bits(&full);
    comm.traffic_mut().set_op("hpz");
    let mut node_full = vec![0f32; c * node.size()];
    host::all_gather_f32(comm, &node, &shard, &mut node_full)?;
    r.hpz = bits(&node_full);
    host::qwz_all_gather(comm, &node, &shard, &mut node_full, &QwzOptions::default())?;
    r.hpz_int8 = bits(&node_full);
    comm.traffic_mut().set_op("bf16");
    let mut full16 = vec![bf16::ZERO; c * w];
    host::all_gather_bf16(comm, &world, &shard16, &mut full16)?;
    r.ag_bf16 = full16.iter().map(|x| x.to_bits()).collect();
    let mut out = vec![0f32; shard_len(n, w)];
    host::dense_reduce_scatter(comm, &world, host::DenseWire::Bf16, &grad, &mut out, Reduce::Mean)?;
    r.rs_bf16 = bits(&out);
    comm.traffic_mut().set_op("qgz");
    host::qgz_reduce_scatter(comm, &grad, &mut out, &QgzOptions::default())?;
    r.qgz = bits(&out);
    host::qgz_reduce_scatter(comm, &grad, &mut out, &stochastic())?;
    r.qgz_sum_stochastic = bits(&out);
    host::qgz_reduce_scatter(comm, &grad, &mut out, &int8_g7())?;
    r.qgz_int8_g7 = bits(&out);
    r.traffic = comm.traffic().snapshot();
    Ok(r)
}

pub(crate) fn on_device<D: Device>(comm: &mut DeviceComm<D>, n: usize) -> Result<Results, CommError> {
    let t = *comm.topology();
    let (w, rank) = (t.world(), comm.rank());
    let d = comm.device().clone();
    let world = Group::world(&t);
    let node = Group::intra_node(&t, rank);
    let up = |comm: &DeviceComm<D>, x: &[f32]| DeviceBuf::from_f32(&d, comm.stream(), x);
    let c = n / 3 + 1;
    let grad = up(comm, &rank_data(5, rank, n))?;
    let shard_host = rank_data(11, rank, c);
    let shard = up(comm, &shard_host)?;
    let shard16_host: Vec<bf16> = shard_host.iter().map(|&x| bf16::from_f32(x)).collect();
    let shard16 = DeviceBuf::from_bytes(&d, comm.stream(), bytemuck::cast_slice(&shard16_host))?;
    let f32s = |b: &DeviceBuf<D>, comm: &DeviceComm<D>| -> Result<Vec<u32>, CommError> {
        Ok(bits(&b.to_f32(&d, comm.stream())?))
    };
    let full = DeviceBuf::zeroed(&d, 4 * c * w)?;
    comm.traffic_mut().set_op("qwz");
    dev::qwz_all_gather(comm, &world, shard.view(), Elem::F32, full.view(), Elem::F32, &qwz_opts())?;
    let qwz_f32 = f32s(&full, comm)?;
    dev::qwz_all_gather(
        comm,
        &world,
        shard16.view(),
        Elem::Bf16,
        full.view(),
        Elem::F32,
        &QwzOptions::default(),
    )?;
    let qwz_bf16 = f32s(&full, comm)?;
    comm.traffic_mut().set_op("hpz");
    let node_full = DeviceBuf::zeroed(&d, 4 * c * node.size())?;
    dev::hpz_all_gather(comm, shard.view(), node_full.view())?;
    let hpz = f32s(&node_full, comm)?;
    dev::hpz_qwz_all_gather(
        comm,
        shard.view(),
        Elem::F32,
        node_full.view(),
        Elem::F32,
        &QwzOptions::default(),
    )?;
    let hpz_int8 = f32s(&node_full, comm)?;
    comm.traffic_mut().set_op("bf16");
    let full16 = DeviceBuf::zeroed(&d, 2 * c * w)?;
    dev::all_gather_bf16(comm, &world, shard16.view(), full16.view())?;
    let ag_bf16 = bytemuck::pod_collect_to_vec(&full16.to_bytes(&d, comm.stream())?);
    let out = DeviceBuf::zeroed(&d, 4 * shard_len(n, w))?;
    dev::reduce_scatter_bf16_wire(comm, &world, grad.view(), out.view(), Reduce::Mean)?;
    let rs_bf16 = f32s(&out, comm)?;
    comm.traffic_mut().set_op("qgz");
    dev::qgz_reduce_scatter(comm, grad.view(), out.view(), &QgzOptions::default())?;
    let qgz = f32s(&out, comm)?;
    dev::qgz_reduce_scatter(comm, grad.view(), out.view(), &stochastic())?;
    let qgz_sum_stochastic = f32s(&out, comm)?;
    dev::qgz_reduce_scatter(comm, grad.view(), out.view(), &int8_g7())?;
    let qgz_int8_g7 = f32s(&out, comm)?;
    let traffic = DeviceComm::traffic(comm).snapshot();
    Ok(Results {
        qwz_f32,
        qwz_bf16,
        hpz,
        hpz_int8,
        ag_bf16,
        rs_bf16,
        qgz,
        qgz_sum_stochastic,
        qgz_int8_g7,
        traffic,
    })
}

#[test]
fn device_collectives_are_bitwise_the_thread_backends() {
    for (w, l) in SHAPES {
        for n in [0, 1, 13, 700, 2048 * w + 5] {
            let expected = thread_cluster(w, l).run(|comm| on_threads(comm, n)).unwrap();
            let got = device_cluster(w, l).run(|comm| on_device(comm, n)).unwrap();
            for (rank, (e, g)) in expected.iter().zip(&got).enumerate() {
                assert_eq!(e, g, "world {w} local {l} n {n} rank {rank}");
            }
        }
    }
}

#[test]
fn device_primitives_give_the_host_errors() {
    // The same bad calls on both traits, the same errors (the shared checks).
    let errs = device_cluster(2, 2)
        .run(|comm| {
            let (d, world) = device_and_world(comm);
            let a = DeviceBuf::zeroed(&d, 2)?;
            let b = DeviceBuf::zeroed(&d, 3)?;
            let dev_err = comm.all_gather(&world, a.view(), b.view()).unwrap_err();
            let host_err = comm.all_gather_bytes(&world, &[0u8; 2], &mut [0u8; 3]).unwrap_err();
            let outside = Group::new(&Topology::ranks(8).per_node(2)?, vec![0, 7])?;
            let dev_group = DeviceCommunicator::barrier(comm, &outside).unwrap_err();
            let host_group = Communicator::barrier(comm, &outside).unwrap_err();
            let dev_root = DeviceCommunicator::broadcast(comm, &world, 2, a.view()).unwrap_err();
            let host_root = Communicator::broadcast_bytes(comm, &world, 2, &mut [0u8; 2]).unwrap_err();
            let rs = DeviceCommunicator::reduce_scatter_f32(comm, &world, a.view(), a.view()).unwrap_err();
            Ok::<_, CommError>((dev_err, host_err, dev_group, host_group, dev_root, host_root, rs))
        })
        .unwrap();
    for (de, he, dg, hg, dr, hr, rs) in errs {
        assert_eq!(de, he);
        assert!(matches!(de, CommError::Mismatch(_)));
        assert_eq!(dg, hg);
        assert!(matches!(dg, CommError::InvalidGroup(_)));
        assert_eq!(dr, hr);
        assert!(matches!(rs, CommError::Mismatch(ref m) if m.contains("whole f32")), "{rs}");
    }
}

#[test]
fn disagreeing_members_get_a_mismatch_and_nobody_hangs() {
    let out = device_cluster(2, 2).run_each(|comm| {
        let (d, world) = device_and_world(comm);
        let len = 4 + comm.rank();
        let a = DeviceBuf::zeroed(&d, len)?;
        let b = DeviceBuf::zeroed(&d, 2 * len)?;
        comm.all_gather(&world, a.view(), b.view())
    });
    for r in out {
        match r {
            Err(zeropp_comm::RunError::Failed { error: CommError::Mismatch(m), .. }) => {
                assert!(m.contains("bytes"), "{m}")
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn a_lost_rank_fails_its_peers_with_peer_lost() {
    let out = device_cluster(3, 3).run_each(|comm| {
        if comm.rank() == 1 {
            panic!("rank 1 gives up");
        }
        DeviceCommunicator::barrier(comm, &Group::world(comm.topology()))
    });
    assert!(matches!(out[1], Err(zeropp_comm::RunError::Panicked { rank: 1, .. })));
    for r in [&out[0], &out[2]] {
        assert!(
            matches!(
                r,
                Err(zeropp_comm::RunError::Failed { error: CommError::PeerLost { rank: 1, .. }, .. })
            ),
            "{r:?}"
        );
    }
}

#[test]
fn duplicates_are_independent_streams_of_collectives() {
    let out = device_cluster(4, 2)
        .run(|comm| {
            let (d, world) = device_and_world(comm);
            let mut dup = DeviceCommunicator::duplicate(comm)?;
            let x = DeviceBuf::from_f32(&d, comm.stream(), &[comm.rank() as f32])?;
            let y = DeviceBuf::from_f32(&d, comm.stream(), &[1.0])?;
            // Opposite orders on the two communicators of odd and even ranks would
            // deadlock one shared sequence; independent ones complete.
            if comm.rank() % 2 == 0 {
                std::thread::scope(|s| {
                    let h = s.spawn(|| DeviceCommunicator::all_reduce_f32(&mut dup, &world, y.view()));
                    DeviceCommunicator::all_reduce_f32(comm, &world, x.view())?;
                    h.join().unwrap()
                })?;
            } else {
                std::thread::scope(|s| {
                    let h = s.spawn(|| DeviceCommunicator::all_reduce_f32(&mut *comm, &world, x.view()));
                    DeviceCommunicator::all_reduce_f32(&mut dup, &world, y.view())?;
                    h.join().unwrap()
                })?;
            }
            Ok::<_, CommError>((x.to_f32(&d, comm.stream())?, y.to_f32(&d, comm.stream())?))
        })
        .unwrap();
    for (x, y) in out {
        assert_eq!((x, y), (vec![6.0], vec![4.0]));
    }
}

#[test]
fn link_model_keeps_results() {
    let model = "intra=10GB/s,inter=1GB/s,latency=1us".parse().unwrap();
    let t = Topology::ranks(4).per_node(2).unwrap();
    let cluster = DeviceCluster::new(t, HostDevice, opts().with_link_model(model));
    let expected = thread_cluster(4, 2).run(|comm| on_threads(comm, 300)).unwrap();
    let got = cluster.run(|comm| on_device(comm, 300)).unwrap();
    assert_eq!(expected, got);
}

pub(crate) type Step = (Vec<u32>, Vec<u32>, Vec<u32>);

/// Three steps of qgZ with LoCo on the thread backend: output and both residuals after each.
pub(crate) fn host_feedback_steps(
    comm: &mut zeropp_comm::ThreadComm,
    n: usize,
    opts: &QgzOptions,
) -> Result<Vec<Step>, CommError> {
    let w = comm.topology().world();
    let mut fb = host::ErrorFeedback::loco(0.8);
    let mut out = vec![0f32; shard_len(n, w)];
    (0..3)
        .map(|step| {
            let grad = rank_data(step, comm.rank(), n);
            host::qgz_reduce_scatter_with_feedback(comm, &grad, &mut out, opts, &mut fb)?;
            Ok((bits(&out), bits(&fb.residual()), bits(&fb.inter_residual())))
        })
        .collect()
}

/// The same three steps with the device collective and device residuals.
pub(crate) fn device_feedback_steps<D: Device>(
    comm: &mut DeviceComm<D>,
    n: usize,
    opts: &QgzOptions,
) -> Result<Vec<Step>, CommError> {
    let w = comm.topology().world();
    let d = comm.device().clone();
    let mut fb = DeviceFeedback::upload(&d, comm.stream(), &host::ErrorFeedback::loco(0.8))?;
    let out = DeviceBuf::zeroed(&d, 4 * shard_len(n, w))?;
    (0..3)
        .map(|step| {
            let grad = DeviceBuf::from_f32(&d, comm.stream(), &rank_data(step, comm.rank(), n))?;
            dev::qgz_reduce_scatter_with_feedback(comm, grad.view(), out.view(), opts, &mut fb)?;
            let state = fb.download(&d, comm.stream())?;
            Ok((
                bits(&out.to_f32(&d, comm.stream())?),
                bits(&state.residual()),
                bits(&state.inter_residual()),
            ))
        })
        .collect()
}

/// qgZ's options the device must run as the host does: the default, stochastic
/// rounding, the two-level specs (INT8 inside the node, INT4 across) and the
/// Hadamard rotation, alone and together.
pub(crate) fn feedback_options() -> Vec<QgzOptions> {
    let g64 = QuantSpec::int4(64).unwrap();
    let two_level = QgzOptions::two_level(64).unwrap();
    vec![
        QgzOptions::default(),
        stochastic(),
        QgzOptions { quant: Options::default().stochastic(3), ..two_level },
        QgzOptions { local_spec: QuantSpec::int8(64).unwrap(), ..QgzOptions::default().with_spec(g64) }
            .with_hadamard(11),
        QgzOptions { quant: Options::default().stochastic(5), ..two_level.with_hadamard(12) },
    ]
}

/// Three steps of qgZ with LoCo error feedback: outputs and both residuals equal
/// the host's (`qgz_reduce_scatter_with_feedback`) bit for bit after every step.
#[test]
fn device_qgz_feedback_is_bitwise_the_hosts() {
    for (w, l) in SHAPES {
        for n in [13, 2048 * w + 5] {
            for opts in feedback_options() {
                let host = thread_cluster(w, l).run(|comm| host_feedback_steps(comm, n, &opts)).unwrap();
                let device = device_cluster(w, l).run(|comm| device_feedback_steps(comm, n, &opts)).unwrap();
                assert_eq!(host, device, "world {w} local {l} n {n}");
            }
        }
    }
}

/// What every device must do with views at offsets that are not multiples of
/// their element size: f32 / bf16 views fail with the shared alignment error
/// (a GPU would raise a sticky CUDA_ERROR_MISALIGNED_ADDRESS instead), and wire
/// encodings at odd offsets (back to back in the collectives' buffers) give the
/// host kernels' result. Returns the error messages of the refused calls and
/// the dequantized values of an encoding at offset 1.
pub(crate) fn misaligned_views<D: Device>(
    comm: &mut DeviceComm<D>,
) -> Result<(Vec<String>, Vec<f32>), CommError> {
    let (d, world) = (comm.device().clone(), Group::world(comm.topology()));
    let w = world.size();
    let buf = DeviceBuf::zeroed(&d, 4 * 8 * w + 128)?;
    let f32s_at = |off: usize, floats: usize| buf.slice(off, 4 * floats);
    let mut errors = Vec::new();
    let mut refuse = |what: &str, r: Result<(), CommError>| match r {
        Err(e) => errors.push(format!("{what}: {e}")),
        Ok(()) => errors.push(format!("{what}: accepted")),
    };
    let int8 = QuantSpec::int8(4)?;
    {
        let s = comm.stream();
        let kernel = |k: Kernel<'_, D>| d.kernel(s, k);
        refuse(
            "add into a misaligned accumulator",
            kernel(Kernel::Add { src: f32s_at(0, 4)?, elem: Elem::F32, dst: f32s_at(18, 4)? }),
        );
        refuse(
            "quantize a misaligned f32 input",
            kernel(Kernel::Quantize {
                src: f32s_at(2, 4)?,
                elem: Elem::F32,
                spec: int8,
                opts: Options::default(),
                dst: buf.slice(64, encoded_len(int8, 4))?,
            }),
        );
        refuse("divide a misaligned vector", kernel(Kernel::Div { buf: f32s_at(6, 2)?, by: 2.0 }));
        refuse(
            "bf16 output at an odd offset",
            kernel(Kernel::ToBf16 { src: f32s_at(0, 2)?, dst: buf.slice(33, 4)? }),
        );
    }
    refuse(
        "reduce-scatter from a misaligned view",
        DeviceCommunicator::reduce_scatter_f32(comm, &world, f32s_at(2, 2 * w)?, f32s_at(4 * 4 * w, 2)?),
    );
    // An encoding at offset 1 is fine: the device realigns it.
    let s = comm.stream();
    let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
    let spec = QuantSpec::int4(5)?;
    let enc = zeropp_quant::quantize(&x, spec, &Options::default())?.to_bytes();
    let wire = DeviceBuf::zeroed(&d, enc.len() + 1)?;
    d.upload(s, &enc, wire.slice(1, enc.len())?)?;
    let out = DeviceBuf::zeroed(&d, 4 * x.len())?;
    let src = wire.slice(1, enc.len())?;
    d.kernel(s, Kernel::Dequantize { src, spec, len: x.len(), dst: out.view(), add: false })?;
    Ok((errors, out.to_f32(&d, s)?))
}

/// The expected outcome of [`misaligned_views`] on any device.
pub(crate) fn check_misaligned(results: Vec<(Vec<String>, Vec<f32>)>) {
    let x: Vec<f32> = (0..37).map(|i| (i as f32 * 0.37).sin()).collect();
    let q = zeropp_quant::quantize(&x, QuantSpec::int4(5).unwrap(), &Options::default()).unwrap();
    let want = zeropp_quant::dequantize(&q, &Options::default()).unwrap();
    for (errors, got) in results {
        assert_eq!(errors.len(), 5);
        for e in &errors {
            assert!(e.contains("not aligned to its"), "{e}");
        }
        assert_eq!(bits(&got), bits(&want), "an encoding at offset 1 dequantized differently");
    }
}

#[test]
fn misaligned_element_views_are_refused_and_wire_views_realigned() {
    check_misaligned(device_cluster(2, 2).run(misaligned_views).unwrap());
}
