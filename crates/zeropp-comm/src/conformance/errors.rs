//! The checks of argument errors: every bad call fails the same way, with the
//! same words, on every backend.

use crate::{CommError, CommExt, Communicator, Group, Primitive, Topology};

use super::common::*;

/// Every primitive with every kind of bad argument: a group with a rank outside the
/// world, a group without the caller, buffers of the wrong lengths, counts of the
/// wrong number or that do not add up, and a broadcast root outside the group. Each
/// call must fail with exactly the error the [`Communicator`] checks document
/// (variant and words, the same on every backend), count no traffic, and leave the
/// communicator usable. Collective: every rank makes the same bad calls (so on a
/// backend whose members agree on errors, every member rejects its own
/// arguments). Returns the number of checks that passed.
pub fn check_argument_errors<C: Communicator + ?Sized>(comm: &mut C) -> Result<usize, String> {
    let topo = *comm.topology();
    let (w, me) = (topo.world(), comm.rank());
    let world = Group::world(&topo);
    let before = comm.traffic().snapshot();
    let mut checks = 0usize;
    let mut expect = |what: &str, got: Result<(), CommError>, want: CommError| -> Result<(), String> {
        match got {
            Err(e) if e == want => {
                checks += 1;
                Ok(())
            }
            Err(e) => Err(format!("{what}: rank {me} got the error {e:?}, expected {want:?}")),
            Ok(()) => Err(format!("{what}: rank {me} got Ok, expected {want:?}")),
        }
    };
    let mismatch = |m: String| CommError::Mismatch(m);
    let invalid = |m: String| CommError::InvalidGroup(m);

    // 1. Bad groups, for every primitive (arguments otherwise valid for the group):
    //    a member outside the world (a fixed message), a group without the caller.
    let bigger = Topology::ranks(w + 1).per_node(1).map_err(|e| e.to_string())?;
    let outside = Group::new(&bigger, vec![me, w]).map_err(|e| e.to_string())?;
    let mut bad_groups = vec![(outside, Some(format!("rank {w} is outside a world of {w}")))];
    if w > 1 {
        bad_groups.push((Group::new(&topo, vec![(me + 1) % w]).map_err(|e| e.to_string())?, None));
    }
    for (group, fixed) in &bad_groups {
        let want = |p: Primitive| {
            invalid(fixed.clone().unwrap_or_else(|| {
                format!("rank {me} called {p} on group {:?} without being a member", group.ranks())
            }))
        };
        let n = group.size();
        let mut recv = vec![0u8; n];
        let r = comm.all_gather_bytes(group, &[1], &mut recv);
        expect("all_gather, bad group", r, want(Primitive::AllGather))?;
        let r = comm.all_to_all_bytes(group, &vec![1; n], &mut recv);
        expect("all_to_all, bad group", r, want(Primitive::AllToAll))?;
        let ones = vec![1usize; n];
        let r = comm.all_to_all_v_bytes(group, &vec![1; n], &ones, &mut recv, &ones);
        expect("all_to_all_v, bad group", r, want(Primitive::AllToAllV))?;
        let r = comm.reduce_scatter_f32(group, &vec![1.0; n], &mut [0.0]);
        expect("reduce_scatter, bad group", r, want(Primitive::ReduceScatter))?;
        let r = comm.all_reduce_f32(group, &mut [1.0]);
        expect("all_reduce, bad group", r, want(Primitive::AllReduce))?;
        let r = comm.broadcast_bytes(group, 0, &mut [0u8; 2]);
        expect("broadcast, bad group", r, want(Primitive::Broadcast))?;
        let r = comm.barrier(group);
        expect("barrier, bad group", r, want(Primitive::Barrier))?;
    }

    // 2. Bad arguments on the world group.
    let mut recv = vec![0u8; 3 * w + 1];
    let r = comm.all_gather_bytes(&world, &[7; 3], &mut recv);
    expect(
        "all_gather, receive buffer one byte too long",
        r,
        mismatch(format!("all_gather: receive buffer of {} bytes for {w} chunks of 3 bytes", 3 * w + 1)),
    )?;
    let r = comm.all_gather_bytes(&world, &[7; 3], &mut []);
    expect(
        "all_gather, empty receive buffer",
        r,
        mismatch(format!("all_gather: receive buffer of 0 bytes for {w} chunks of 3 bytes")),
    )?;
    let r = comm.all_to_all_bytes(&world, &vec![7; 2 * w], &mut recv[..2 * w + 1]);
    expect(
        "all_to_all, send and receive lengths differ",
        r,
        mismatch(format!(
            "all_to_all: send {} and receive {} bytes must be equal multiples of the group size {w}",
            2 * w,
            2 * w + 1
        )),
    )?;
    if w > 1 {
        let r = comm.all_to_all_bytes(&world, &vec![7; 2 * w + 1], &mut recv[..2 * w + 1]);
        expect(
            "all_to_all, lengths not a multiple of the group size",
            r,
            mismatch(format!(
                "all_to_all: send {0} and receive {0} bytes must be equal multiples of the group size {w}",
                2 * w + 1
            )),
        )?;
    }
    let ones = vec![1usize; w];
    let one_more = vec![1usize; w + 1];
    let mut recv = vec![0u8; w + 1];
    let r = comm.all_to_all_v_bytes(&world, &vec![7; w + 1], &one_more, &mut recv[..w], &ones);
    expect(
        "all_to_all_v, one send count too many",
        r,
        mismatch(format!("all_to_all_v: {} send and {w} receive counts for a group of {w}", w + 1)),
    )?;
    let r = comm.all_to_all_v_bytes(&world, &vec![7; w], &ones, &mut recv, &one_more[..w - 1]);
    expect(
        "all_to_all_v, one receive count too few",
        r,
        mismatch(format!("all_to_all_v: {w} send and {} receive counts for a group of {w}", w - 1)),
    )?;
    let r = comm.all_to_all_v_bytes(&world, &vec![7; w + 1], &ones, &mut recv[..w], &ones);
    expect(
        "all_to_all_v, send counts do not add up",
        r,
        mismatch(format!(
            "all_to_all_v: counts do not add up to the buffer lengths (send counts {w} for {} bytes, receive counts {w} for {w} bytes)",
            w + 1
        )),
    )?;
    let r = comm.all_to_all_v_bytes(&world, &vec![7; w], &ones, &mut recv, &ones);
    expect(
        "all_to_all_v, receive counts do not add up",
        r,
        mismatch(format!(
            "all_to_all_v: counts do not add up to the buffer lengths (send counts {w} for {w} bytes, receive counts {w} for {} bytes)",
            w + 1
        )),
    )?;
    // Counts whose sum overflows (reported saturated, never wrapped or panicking).
    let mut huge = vec![0usize; w];
    huge[me] = usize::MAX;
    if w > 1 {
        huge[(me + 1) % w] = 2;
    }
    let r = comm.all_to_all_v_bytes(&world, &[7; 1], &huge, &mut recv[..1], &huge);
    expect(
        "all_to_all_v, counts that overflow",
        r,
        mismatch(format!(
            "all_to_all_v: counts do not add up to the buffer lengths (send counts {0} for 1 bytes, receive counts {0} for 1 bytes)",
            usize::MAX
        )),
    )?;
    if w > 1 {
        // Both sums right (w + 1), but 2 bytes to itself against 1 expected from itself.
        let mut own = vec![1usize; w];
        own[me] = 2;
        let mut more = vec![1usize; w];
        more[(me + 1) % w] = 2;
        let r = comm.all_to_all_v_bytes(&world, &vec![7; w + 1], &own, &mut recv, &more);
        expect(
            "all_to_all_v, own chunk differs",
            r,
            mismatch("all_to_all_v: this rank sends itself 2 bytes but expects 1".into()),
        )?;
    }
    let mut out = [0.0f32; 2];
    let r = comm.reduce_scatter_f32(&world, &vec![1.0; 2 * w + 1], &mut out);
    expect(
        "reduce_scatter, send one element too long",
        r,
        mismatch(format!("reduce_scatter: send of {} elements for {w} chunks of 2", 2 * w + 1)),
    )?;
    let r = comm.reduce_scatter_f32(&world, &vec![1.0; 2 * w], &mut out[..1]);
    expect(
        "reduce_scatter, receive one element too short",
        r,
        mismatch(format!("reduce_scatter: send of {} elements for {w} chunks of 1", 2 * w)),
    )?;
    for root in [w, w + 5] {
        let r = comm.broadcast_bytes(&world, root, &mut [0u8; 4]);
        expect(
            "broadcast, root outside the group",
            r,
            invalid(format!("broadcast root index {root} in a group of {w}")),
        )?;
    }

    // 3. No traffic was counted, and the communicator still works.
    ensure(comm.traffic().snapshot() == before, || {
        format!("rank {me}: rejected calls changed the traffic counters")
    })?;
    let mut all = vec![0u32; w];
    comm.all_gather(&world, &[me as u32], &mut all)
        .map_err(|e| err("all_gather after the rejected calls", e))?;
    ensure(all.iter().enumerate().all(|(r, &v)| v == r as u32), || {
        "all_gather after the rejected calls: wrong result".into()
    })?;
    Ok(checks + 1)
}
