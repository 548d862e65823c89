//! `NcclComm` (feature `nccl`) on one GPU: a world of one rank (one GPU cannot
//! hold two NCCL ranks), bootstrapped over a one-rank thread cluster. Every
//! primitive, a duplicate, the device ZeRO++ collectives against the thread
//! backend, and the shared argument errors. The multi-GPU run is the
//! `nccl_mpi` example under `mpirun` (docs/gpu.md).
//!
//! One `#[test]`: without a device, or without libnccl, it prints one counted
//! line (`gpu: N tests skipped: ...`); `ZEROPP_REQUIRE_GPU=1` makes a missing
//! device a failure, `ZEROPP_REQUIRE_NCCL=1` a missing libnccl.

use std::io::Write as _;

use zeropp_comm::collectives::{QgzOptions, QwzOptions};
use zeropp_comm::conformance::rank_data;
use zeropp_comm::device::{CudaDevice, DeviceBuf, DeviceCommunicator, Elem, NcclComm, collectives as dev};
use zeropp_comm::{CommError, Group, ThreadCluster, ThreadOptions, Topology};
use zeropp_tests::gpu::{REQUIRE_ENV, skip};

const CHECKS: usize = 5;

fn f32s(c: &NcclComm, b: &DeviceBuf<CudaDevice>) -> Vec<f32> {
    b.to_f32(c.device(), c.stream()).unwrap()
}

fn primitives(c: &mut NcclComm) {
    let (d, world) = (c.device().clone(), Group::world(c.topology()));
    let x = rank_data(1, 0, 37);
    let send = DeviceBuf::from_f32(&d, c.stream(), &x).unwrap();
    let out = DeviceBuf::zeroed(&d, send.len()).unwrap();
    c.all_gather(&world, send.view(), out.view()).unwrap();
    assert_eq!(f32s(c, &out), x);
    c.all_to_all(&world, send.view(), out.view()).unwrap();
    assert_eq!(f32s(c, &out), x);
    c.all_to_all_v(&world, send.view(), &[send.len()], out.view(), &[send.len()]).unwrap();
    assert_eq!(f32s(c, &out), x);
    c.reduce_scatter_f32(&world, send.view(), out.view()).unwrap();
    assert_eq!(f32s(c, &out), x.iter().map(|v| 0.0 + v).collect::<Vec<_>>());
    let buf = DeviceBuf::from_f32(&d, c.stream(), &x).unwrap();
    c.all_reduce_f32(&world, buf.view()).unwrap();
    c.broadcast(&world, 0, buf.view()).unwrap();
    c.barrier(&world).unwrap();
    assert_eq!(f32s(c, &buf), x.iter().map(|v| 0.0 + v).collect::<Vec<_>>());
    let mut dup = c.duplicate().unwrap();
    dup.barrier(&world).unwrap();
}

fn errors(c: &mut NcclComm) {
    let (d, world) = (c.device().clone(), Group::world(c.topology()));
    let a = DeviceBuf::zeroed(&d, 2).unwrap();
    let b = DeviceBuf::zeroed(&d, 3).unwrap();
    let err = c.all_gather(&world, a.view(), b.view()).unwrap_err();
    assert_eq!(
        err,
        CommError::Mismatch("all_gather: receive buffer of 3 bytes for 1 chunks of 2 bytes".into())
    );
    assert!(matches!(c.broadcast(&world, 1, a.view()), Err(CommError::InvalidGroup(_))));
    assert!(matches!(c.reduce_scatter_f32(&world, a.view(), a.view()), Err(CommError::Mismatch(_))));
}

fn collectives(c: &mut NcclComm) {
    let d = c.device().clone();
    let world = Group::world(c.topology());
    let x = rank_data(3, 0, 1000);
    // Reference: the host collectives on a one-rank thread cluster.
    let t = *c.topology();
    let (qwz_ref, qgz_ref) = ThreadCluster::new(t, ThreadOptions::default())
        .run(|h| {
            let mut full = vec![0f32; x.len()];
            zeropp_comm::collectives::qwz_all_gather(h, &world, &x, &mut full, &QwzOptions::default())?;
            let mut shard = vec![0f32; x.len()];
            zeropp_comm::collectives::qgz_reduce_scatter(h, &x, &mut shard, &QgzOptions::default())?;
            Ok::<_, CommError>((full, shard))
        })
        .unwrap()
        .remove(0);
    let src = DeviceBuf::from_f32(&d, c.stream(), &x).unwrap();
    let out = DeviceBuf::zeroed(&d, src.len()).unwrap();
    dev::qwz_all_gather(c, &world, src.view(), Elem::F32, out.view(), Elem::F32, &QwzOptions::default())
        .unwrap();
    assert_eq!(f32s(c, &out), qwz_ref);
    dev::qgz_reduce_scatter(c, src.view(), out.view(), &QgzOptions::default()).unwrap();
    assert_eq!(f32s(c, &out), qgz_ref);
}

fn traffic(c: &mut NcclComm) {
    // A world of one sends nothing.
    assert_eq!(c.traffic().snapshot().total(), Default::default());
}

#[test]
fn device_nccl_suite() {
    let device = match CudaDevice::new() {
        Ok(d) => d,
        Err(e) => return skip(CHECKS, &format!("no usable CUDA device ({e})"), REQUIRE_ENV),
    };
    let t = Topology::ranks(1).per_node(1).unwrap();
    let comm = ThreadCluster::new(t, ThreadOptions::default())
        .run(|boot| {
            NcclComm::new(boot, device.clone()).map(Some).or_else(|e| match e {
                CommError::Device { code: -1, .. } => Ok(None),
                e => Err(e),
            })
        })
        .unwrap()
        .remove(0);
    let Some(mut c) = comm else { return skip(CHECKS, "libnccl.so.2 not found", "ZEROPP_REQUIRE_NCCL") };
    let _ = writeln!(
        std::io::stderr(),
        "gpu: NCCL {} on {}",
        c.nccl_version().unwrap_or(0),
        device.gpu().device_name().unwrap_or_default()
    );
    primitives(&mut c);
    errors(&mut c);
    collectives(&mut c);
    traffic(&mut c);
    conformance(&mut c);
}

/// The conformance suite's checks of the ZeRO++ collectives, unchanged, on
/// NCCL's device buffers (a world of one rank).
fn conformance(c: &mut NcclComm) {
    for len in [0, 5, 97] {
        let case = zeropp_comm::conformance::Case { seed: 42, len };
        let r = zeropp_comm::conformance::run_collectives(
            &mut zeropp_comm::conformance::DevicePath(&mut *c),
            &case,
        );
        assert_eq!(r, Ok(()), "NCCL, len {len}");
    }
}
