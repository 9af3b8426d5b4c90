//! A network partition between a client and the daemon, on a Unix socket: the client connects
//! to the relay's path, the relay to the daemon. `cut` ends every connection through it and
//! turns new ones away (accepted and closed at once) until `heal`; the daemon itself goes on,
//! so an operator can act on it while the client cannot hear.

use std::io::Read;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Partition {
    path: PathBuf,
    open: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<UnixStream>>>,
    stop: Arc<AtomicBool>,
}

impl Partition {
    /// Relays `path` to the daemon's socket `target`.
    pub fn start(target: &str, path: &Path) -> Partition {
        let listener = UnixListener::bind(path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let p = Partition {
            path: path.to_path_buf(),
            open: Arc::new(AtomicBool::new(true)),
            conns: Arc::default(),
            stop: Arc::default(),
        };
        let (open, conns, stop) = (p.open.clone(), p.conns.clone(), p.stop.clone());
        let target = target.to_string();
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) if open.load(Ordering::SeqCst) => {
                        client.set_nonblocking(false).unwrap();
                        let Ok(gate) = UnixStream::connect(&target) else {
                            continue;
                        };
                        let mut held = conns.lock().unwrap();
                        held.push(client.try_clone().unwrap());
                        held.push(gate.try_clone().unwrap());
                        pipe(client.try_clone().unwrap(), gate.try_clone().unwrap());
                        pipe(gate, client);
                    }
                    Ok((turned_away, _)) => drop(turned_away),
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        p
    }

    pub fn path(&self) -> String {
        self.path.to_string_lossy().into_owned()
    }

    /// Ends every connection through the relay; new ones are closed at once until `heal`.
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn heal(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.cut();
    }
}

/// Copies `from` to `to` until either ends.
fn pipe(mut from: UnixStream, mut to: UnixStream) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if std::io::Write::write_all(&mut to, &buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(std::net::Shutdown::Both);
    });
}
