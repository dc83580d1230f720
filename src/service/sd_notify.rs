//! systemd readiness (`Type=notify`): tells the service manager when the
//! worker is serving and when it is stopping, through `$NOTIFY_SOCKET`.
//! Without that variable (not started by systemd) nothing is sent.

use std::os::unix::net::UnixDatagram;

/// Sends one notification (`READY=1`, `STOPPING=1`, `STATUS=...`); failures
/// are logged, never fatal: the worker works the same without systemd.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let result = UnixDatagram::unbound().and_then(|sock| {
        let bytes = path.as_encoded_bytes();
        match bytes.strip_prefix(b"@") {
            // An abstract socket name (Linux).
            Some(name) => {
                use std::os::linux::net::SocketAddrExt;
                let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
                sock.send_to_addr(state.as_bytes(), &addr)
            }
            None => sock.send_to(state.as_bytes(), &path),
        }
    });
    if let Err(e) = result {
        tracing::warn!(error = %e, state, "cannot notify systemd");
    }
}
