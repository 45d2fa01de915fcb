//! The group on a real shared-memory segment: ranks attached by name reduce together, and bad
//! segments are clear errors.

use collective::{Collective, GroupError, GroupParams, ShmGroup, NO_BATCH};

fn name(tag: &str) -> String {
    format!("hspipe-test-group-{tag}-{}", std::process::id())
}

fn params(ranks: u32) -> GroupParams {
    GroupParams {
        ranks,
        buf_len: 1000,
        state_len: 10,
        initial_step: 41,
    }
}

#[test]
fn ranks_attached_by_name_reduce_and_a_dead_rank_is_removed_with_its_verdict() {
    let n = name("reduce");
    let launcher = ShmGroup::create(&n, &params(3)).unwrap();
    let m = launcher.membership();
    assert_eq!((m.epoch, m.step, m.members), (1, 41, 0b111));
    let hs: Vec<_> = (0..2u32)
        .map(|r| {
            let n = n.clone();
            std::thread::spawn(move || {
                let g = ShmGroup::attach(&n, r).unwrap();
                let data = vec![r as f32 + 1.0; 1000];
                let mut out = vec![0.0; 1000];
                let red = g.all_reduce(&data, 7, &mut out, &|| false).unwrap();
                (red.step, out[999], red.membership.members)
            })
        })
        .collect();
    // Rank 2 never arrives: the launcher removes it (standing in for its death).
    let gone = launcher.remove(2).unwrap();
    assert!(gone.was_member && gone.committed.is_none());
    for h in hs {
        assert_eq!(h.join().unwrap(), (42, 3.0, 0b011));
    }
    assert_eq!(launcher.membership().step, 42);
    drop(launcher);
    assert!(
        !std::path::Path::new(&format!("/dev/shm/{n}")).exists(),
        "creator unlinks"
    );
}

/// A rank that stops waiting in a round (a Ctrl-C) leaves its contribution there: its arrival
/// says which round, and the others commit it with that contribution while the epoch stands.
#[test]
fn a_rank_that_stops_in_a_round_is_committed_with_its_arrival() {
    let n = name("stopped");
    let _launcher = ShmGroup::create(&n, &params(2)).unwrap();
    let (r0, r1) = (
        ShmGroup::attach(&n, 0).unwrap(),
        ShmGroup::attach(&n, 1).unwrap(),
    );
    assert_eq!(r1.arrival(), None);
    let (data, mut out) = (vec![1.0; 1000], vec![0.0; 1000]);
    let e = r1.all_reduce(&data, 7, &mut out, &|| true).unwrap_err();
    assert_eq!(e, GroupError::Stopped);
    assert_eq!(
        r1.arrival(),
        Some((1, 42)),
        "its contribution to step 42, epoch 1"
    );
    assert_eq!(r1.membership().step, 41, "undecided");
    let red = r0.all_reduce(&data, 8, &mut out, &|| false).unwrap();
    assert_eq!(
        (red.step, out[0]),
        (42, 2.0),
        "committed with the stopped rank's data"
    );
}

#[test]
fn a_restarted_rank_joins_with_the_leaders_state() {
    let n = name("join");
    let launcher = ShmGroup::create(&n, &params(2)).unwrap();
    launcher.remove(1).unwrap();
    let leader = ShmGroup::attach(&n, 0).unwrap();
    let n2 = n.clone();
    let joiner = std::thread::spawn(move || {
        let g = ShmGroup::attach(&n2, 1).unwrap();
        let mut state = [0u32; 10];
        let (m, step) = g.join(&mut state, 0, &|| false).unwrap();
        let mut out = vec![0.0; 1000];
        g.all_reduce(&vec![2.0; 1000], 5, &mut out, &|| false)
            .unwrap();
        (state, step, m.members, out[0])
    });
    let state: Vec<u32> = (100..110).collect();
    while !leader.joiners_waiting() || leader.admit_joiners(41, &state).unwrap() == 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut out = vec![0.0; 1000];
    leader
        .all_reduce(&vec![1.0; 1000], NO_BATCH, &mut out, &|| false)
        .unwrap();
    let (got, step, members, sum) = joiner.join().unwrap();
    assert_eq!(
        (got.to_vec(), step, members, sum),
        (state, Some(41), 0b11, 3.0)
    );
    assert_eq!(out[0], 3.0);
}

#[test]
fn bad_segments_and_bad_params_are_clear_errors() {
    let err = ShmGroup::attach(&name("missing"), 0).err().unwrap();
    assert!(err.to_string().contains("missing"), "{err}");

    let n = name("dup");
    let _g = ShmGroup::create(&n, &params(2)).unwrap();
    let err = ShmGroup::create(&n, &params(2)).err().unwrap();
    assert!(err.to_string().contains("create"), "{err}");
    assert!(matches!(
        ShmGroup::attach(&n, 2),
        Err(GroupError::Rank { rank: 2, ranks: 2 })
    ));

    let err = ShmGroup::create(&name("big"), &params(17)).err().unwrap();
    assert!(err.to_string().contains("17 ranks"), "{err}");

    // Not a group: a file of zeros, then one that lets others in.
    let n = name("foreign");
    let path = format!("/dev/shm/{n}");
    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let err = ShmGroup::attach(&n, 0).err().unwrap();
    assert!(err.to_string().contains("bad magic"), "{err}");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let err = ShmGroup::attach(&n, 0).err().unwrap();
    assert!(err.to_string().contains("lets others in"), "{err}");
    std::fs::remove_file(&path).unwrap();
}
