//! Faults: lost peers, timeouts and mismatched collectives never hang or give garbage.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap

use std::time::{Duration, Instant};

use zeropp_comm::{
    CommError, CommExt, Communicator, Group, RunError, ThreadCluster, ThreadComm, ThreadOptions, Topology,
};

fn cluster(w: usize, l: usize, timeout_ms: u64) -> ThreadCluster {
    ThreadCluster::new(
        Topology::ranks(w).per_node(l).unwrap(),
        ThreadOptions::default().with_timeout(Duration::from_millis(timeout_ms)),
    )
}

/// Runs `f(comm, world)` on every rank of a `w`×`l` cluster with a 2 s receive
/// timeout and checks that the run came back in under 1.5 s (a failure reached
/// the peers, not the timeout); returns the cluster and every rank's outcome.
fn run_quickly(
    w: usize,
    l: usize,
    f: impl Fn(&mut ThreadComm, &Group) -> Result<(), CommError> + Sync,
) -> (ThreadCluster, Vec<Result<(), RunError<CommError>>>) {
    let c = cluster(w, l, 2_000);
    let start = Instant::now();
    let out = c.run_each(|comm| f(comm, &Group::world(comm.topology())));
    assert!(start.elapsed() < Duration::from_millis(1_500), "took {:?}", start.elapsed());
    (c, out)
}

#[test]
fn panicking_rank_makes_every_peer_fail_with_peer_lost() {
    let (c, out) = run_quickly(4, 2, |comm, world| {
        comm.barrier(world)?;
        if comm.rank() == 1 {
            panic!("injected failure");
        }
        let mut buf = vec![0u8; 16 * 4];
        comm.all_gather_bytes(world, &[comm.rank() as u8; 16], &mut buf)?;
        Ok(())
    });
    for (rank, r) in out.iter().enumerate() {
        match (rank, r) {
            (1, Err(RunError::Panicked { rank: 1, message })) => assert!(message.contains("injected")),
            (_, Err(RunError::Failed { error: CommError::PeerLost { rank: 1, .. }, .. })) => {}
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    let err = c
        .run(|comm| -> Result<(), CommError> {
            if comm.rank() == 3 {
                panic!("again");
            }
            comm.barrier(&Group::world(comm.topology()))
        })
        .unwrap_err();
    assert!(matches!(err, RunError::Panicked { rank: 3, .. }), "{err}");
}

#[test]
fn rank_returning_early_makes_peers_fail() {
    let (_, out) = run_quickly(8, 4, |comm, world| {
        if comm.rank() == 5 {
            return Ok(()); // skips the collective
        }
        let mut x = vec![1.0f32; 10];
        comm.all_reduce_f32(world, &mut x)
    });
    for (rank, r) in out.iter().enumerate() {
        if rank == 5 {
            assert!(r.is_ok());
        } else {
            assert!(
                matches!(r, Err(RunError::Failed { error: CommError::PeerLost { .. }, .. })),
                "rank {rank}: {r:?}"
            );
        }
    }
}

#[test]
fn a_lost_peer_reaches_a_duplicated_stream_too() {
    let c = cluster(2, 1, 5_000);
    let start = Instant::now();
    let out = c.run_each(|comm| -> Result<(), CommError> {
        let mut dup = comm.duplicate()?;
        if comm.rank() == 0 {
            std::mem::forget(dup); // keep its channels alive; only the rank's exit announces the loss
            panic!("dies holding a duplicate");
        }
        dup.barrier(&Group::world(comm.topology()))
    });
    assert!(start.elapsed() < Duration::from_secs(2));
    assert!(
        matches!(out[1], Err(RunError::Failed { error: CommError::PeerLost { rank: 0, .. }, .. })),
        "{:?}",
        out[1]
    );
}

#[test]
fn silent_peer_times_out() {
    let c = cluster(2, 2, 200);
    let start = Instant::now();
    let out = c.run_each(|comm| -> Result<(), CommError> {
        if comm.rank() == 0 {
            std::thread::sleep(Duration::from_millis(800));
            return Ok(());
        }
        comm.barrier(&Group::world(comm.topology()))
    });
    let el = start.elapsed();
    assert!(
        matches!(out[1], Err(RunError::Failed { error: CommError::Timeout { rank: 0, .. }, .. })),
        "{:?}",
        out[1]
    );
    assert!(el < Duration::from_secs(2));
}

#[test]
fn mismatched_lengths_are_an_error() {
    let c = cluster(4, 2, 2_000);
    let out = c.run_each(|comm| -> Result<(), CommError> {
        let world = Group::world(comm.topology());
        let len = if comm.rank() == 2 { 5 } else { 4 };
        let mut recv = vec![0u8; len * 4];
        comm.all_gather_bytes(&world, &vec![1u8; len], &mut recv)
    });
    for (rank, r) in out.iter().enumerate() {
        assert!(
            matches!(r, Err(RunError::Failed { error: CommError::Mismatch(_), .. })),
            "rank {rank}: {r:?}"
        );
    }
    let out = c.run_each(|comm| -> Result<(), CommError> {
        let world = Group::world(comm.topology());
        let mut buf = vec![0u8; if comm.rank() == 0 { 8 } else { 9 }];
        comm.broadcast_bytes(&world, 0, &mut buf)
    });
    assert!(
        out.iter().skip(1).all(|r| matches!(r, Err(RunError::Failed { error: CommError::Mismatch(_), .. })))
    );
}

#[test]
fn collectives_in_different_orders_are_an_error() {
    let c = cluster(2, 1, 2_000);
    let out = c.run_each(|comm| -> Result<(), CommError> {
        let world = Group::world(comm.topology());
        let mut x = [0u8; 2];
        if comm.rank() == 0 {
            comm.barrier(&world)?;
            comm.all_gather_bytes(&world, &[1], &mut x)
        } else {
            comm.all_gather_bytes(&world, &[1], &mut x)?;
            comm.barrier(&world)
        }
    });
    for r in &out {
        assert!(matches!(r, Err(RunError::Failed { error: CommError::Mismatch(_), .. })), "{r:?}");
    }
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let c = cluster(4, 2, 2_000);
    let out = c.run(|comm| -> Result<(), String> {
        let t = *comm.topology();
        let other_node = Group::intra_node(&t, (comm.rank() + 2) % 4);
        let e = comm.barrier(&other_node).unwrap_err();
        assert!(matches!(e, CommError::InvalidGroup(_)));
        let world = Group::world(&t);
        let e = comm.all_gather(&world, &[1u32], &mut [0u32; 3]).unwrap_err();
        assert!(matches!(e, CommError::Mismatch(_)));
        let e = comm.broadcast_bytes(&world, 9, &mut [0u8]).unwrap_err();
        assert!(matches!(e, CommError::InvalidGroup(_)));
        Ok(())
    });
    assert!(out.is_ok());
}
