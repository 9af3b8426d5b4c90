//! Finding 5 of issue 11: a panic on the core or the ledger's sync thread left a process that
//! answered `unavailable` forever (or hung). The daemon's panic hook ends the process instead,
//! with a clear message and a non-zero status. Each case runs in a child process (this test
//! binary, re-executed) so the exit is observable.

use estop_server::fatal::{FATAL_EXIT_CODE, FATAL_THREADS, install_panic_hook};
use std::process::Command;

const CHILD: &str = "ESTOP_FATAL_TEST_THREAD";

/// In the child: install the hook, panic on a thread of the given name, and report if the
/// process is still alive afterwards.
fn child(thread: &str) -> ! {
    install_panic_hook();
    let _ = std::thread::Builder::new()
        .name(thread.to_string())
        .spawn(|| panic!("a planted bug"))
        .unwrap()
        .join();
    println!("still alive after the panic");
    std::process::exit(0);
}

fn run_child(test: &str, thread: &str) -> std::process::Output {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, thread)
        .output()
        .unwrap()
}

#[test]
fn a_panic_on_the_core_or_sync_thread_ends_the_process_with_a_clear_message() {
    if let Ok(thread) = std::env::var(CHILD) {
        child(&thread);
    }
    for thread in FATAL_THREADS {
        let out = run_child(
            "a_panic_on_the_core_or_sync_thread_ends_the_process_with_a_clear_message",
            thread,
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(FATAL_EXIT_CODE),
            "{thread}: {stderr}"
        );
        assert!(
            stderr.contains(&format!("fatal: the {thread} thread panicked")),
            "{stderr}"
        );
        assert!(stderr.contains("a planted bug"), "{stderr}");
        assert!(!String::from_utf8_lossy(&out.stdout).contains("still alive"));
    }
}

#[test]
fn a_panic_on_another_thread_is_not_fatal() {
    if let Ok(thread) = std::env::var(CHILD) {
        child(&thread);
    }
    let out = run_child("a_panic_on_another_thread_is_not_fatal", "estop-io");
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("still alive"));
}
