//! `serve`: the long-running worker. Starts the image server, the metrics
//! listener and the broker consumer, and runs until SIGTERM/SIGINT.
//!
//! # This folder
//!
//! Holds `serve` (starts the image server, the operations listener, the
//! broker consumer and housekeeping; stops them on SIGTERM) and systemd
//! readiness. Must not know the pipeline's internals.

pub(crate) mod sd_notify;

use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use crate::http::{self, Health, ImageRoots};
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Runs the worker until a termination signal; `files` names the
/// configuration files read, for the start-up line.
pub async fn serve(config: Config, files: &str) -> Result<()> {
    let metrics = Arc::new(Metrics::new());
    let limits = image_server_limits(&config);
    let security = image_server_security(&config, &metrics)?;
    let settings = crate::broker::Settings::of(&config);
    let brokers = crate::broker::Brokers::new(&settings.amqp)?;
    // Listen first: a worker that cannot (a port in use) stops before it
    // makes or changes anything on disk.
    let image_listener = bind("[http]listen", config.http.listen).await?;
    let ops_listener = bind("[metrics]listen", config.metrics.listen).await?;
    let pipeline = Arc::new(Pipeline::new(config.clone(), metrics.clone())?);
    pipeline.recover()?;
    let roots = ImageRoots::new(
        &config.deploy.http_root,
        &[&config.pxe.instance_master_path, &config.pxe.images_path],
    )
    .map_err(|e| Error::io("resolve served directories", e))?;
    announce(&config, limits, &security, files);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let connected = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let health = health_of(&config, &connected);
    let images = tokio::spawn(http::serve_images(
        image_listener,
        roots,
        metrics.clone(),
        (limits, security, access_log(&config)),
        stopped(stop_rx.clone()),
    ));
    let ops = tokio::spawn(http::serve_ops(
        ops_listener,
        metrics.clone(),
        health,
        limits,
        stopped(stop_rx.clone()),
    ));
    let peers = spawn_peer_listener(
        &config,
        &pipeline,
        &metrics,
        limits,
        stopped(stop_rx.clone()),
    )
    .await?;
    start_peer_link(&settings, &pipeline, &metrics, &stop_rx)?;
    let consumer = tokio::spawn(crate::broker::run(
        pipeline.clone(),
        metrics.clone(),
        settings,
        brokers,
        connected,
        stop_rx.clone(),
    ));
    let housekeeping = tokio::spawn(housekeeping(
        pipeline.clone(),
        config.cache.clean_interval,
        stop_rx.clone(),
    ));
    // Images are served from here on; the broker connection (which may come
    // later, with retries) is reported by /readyz, not by systemd.
    crate::service::sd_notify::notify("READY=1\nSTATUS=serving images; broker state on /readyz");
    shutdown_signal().await;
    crate::service::sd_notify::notify("STOPPING=1");
    tracing::info!("shutting down: finishing in-flight work");
    let _ = stop_tx.send(true);
    let _ = consumer.await;
    let _ = housekeeping.await;
    let servers = [Some(images), Some(ops), peers].into_iter().flatten();
    stop_servers(servers.collect()).await;
    tracing::info!("stopped");
    Ok(())
}

/// The start-up line: where the worker serves, what it read, what next.
fn announce(config: &Config, limits: http::Limits, security: &http::Security, files: &str) {
    tracing::info!(
        host = %config.default.host,
        images = %config.http.listen,
        metrics = %config.metrics.listen,
        http_url = %config.http_url(),
        max_connections = limits.max_connections,
        tls = security.tls.is_some(),
        basic_auth = security.auth.is_some(),
        configuration = files,
        next = "check `ironic-image-worker config show`; try `ironic-image-worker send prepare \
                --node <uuid> --image-source <url> --wait`; /readyz on the metrics address says \
                when the broker is connected",
        "ironic-image-worker serving"
    );
}

/// Waits for the listeners to finish: downloads by nodes may last long, so
/// they get a moment, then stop.
async fn stop_servers(servers: Vec<tokio::task::JoinHandle<std::io::Result<()>>>) {
    let all = async {
        for server in servers {
            let _ = server.await;
        }
    };
    if tokio::time::timeout(std::time::Duration::from_secs(5), all)
        .await
        .is_err()
    {
        tracing::info!("closing remaining image downloads");
    }
}

/// Connects the peers' link to the broker when `[peers]` is on and hands
/// it to the pipeline, so a miss asks the other workers first.
fn start_peer_link(
    settings: &crate::broker::Settings,
    pipeline: &Arc<Pipeline>,
    metrics: &Arc<Metrics>,
    stop: &watch::Receiver<bool>,
) -> Result<()> {
    if settings.peers.enabled() {
        let brokers = crate::broker::Brokers::new(&settings.amqp)?;
        let link = crate::broker::peers::start(
            pipeline.clone(),
            settings,
            brokers,
            metrics.clone(),
            stop.clone(),
        )?;
        pipeline.enable_peers(link)?;
    }
    Ok(())
}

/// Starts the peer listener when `[peers]` is on: masters served to the
/// other workers, on its own address (the management network).
async fn spawn_peer_listener(
    config: &Config,
    pipeline: &Pipeline,
    metrics: &Arc<Metrics>,
    limits: http::Limits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<Option<tokio::task::JoinHandle<std::io::Result<()>>>> {
    let (Some(listen), true) = (config.peers.listen, config.peers.enabled()) else {
        return Ok(None);
    };
    let server = http::peers::PeerServer {
        masters: config.pxe.instance_master_path.clone(),
        secret: config.peers.load_secret()?,
        max_uploads: config.peers.max_uploads,
        live: pipeline.live_masters(),
    };
    let listener = bind("[peers]listen", listen).await?;
    tracing::info!(peers = %listen, "serving masters to peers");
    let limits = http::Limits {
        max_connections: http::listener::OPS_MAX_CONNECTIONS,
        ..limits
    };
    Ok(Some(tokio::spawn(http::peers::serve_peers(
        listener,
        server,
        metrics.clone(),
        limits,
        shutdown,
    ))))
}

/// What `/readyz` checks: the directories the worker writes, and the broker
/// connection the consumer reports in `connected`.
fn health_of(config: &Config, connected: &Arc<std::sync::atomic::AtomicBool>) -> Health {
    Health {
        dirs: vec![
            config.pxe.instance_master_path.clone(),
            config.pxe.images_path.clone(),
            config
                .deploy
                .http_root
                .join(&config.deploy.http_image_subdir),
        ],
        broker: Some(connected.clone()),
    }
}

/// Applies the cache policy every `every` seconds (`[cache]clean_interval`,
/// 0: never; not only when an image is used), after expiring node files no
/// command asked for (`[cache]node_files_ttl`), and refreshes the cache
/// gauges every few seconds.
async fn housekeeping(pipeline: Arc<Pipeline>, every: u64, mut stop: watch::Receiver<bool>) {
    const GAUGES_EVERY: std::time::Duration = std::time::Duration::from_secs(15);
    let mut last_clean: Option<std::time::Instant> = None;
    loop {
        let due = every > 0
            && last_clean.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(every));
        if due {
            last_clean = Some(std::time::Instant::now());
        }
        let p = pipeline.clone();
        let _ = tokio::task::spawn_blocking(move || {
            // Node files first: a master they alone kept linked can then
            // be evicted in the same pass.
            if due && let Err(e) = p.expire_node_files() {
                tracing::warn!(error = %e, "periodic expiry of node files failed");
            }
            if due && let Err(e) = p.clean_cache(0, false, false) {
                tracing::warn!(error = %e, "periodic cache clean-up failed");
            }
            p.refresh_gauges();
        })
        .await;
        tokio::select! {
            _ = tokio::time::sleep(GAUGES_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// The image server's timeouts and connection cap; the cap stays below the
/// open-file limit (raised to the hard limit first) with descriptors kept
/// for the pipeline, the broker and the metrics listener.
fn image_server_limits(config: &Config) -> http::Limits {
    let fd_limit = crate::http::listener::raise_open_file_limit();
    let headroom = crate::http::listener::descriptor_headroom(config.amqp.prefetch);
    http::Limits {
        header_timeout: std::time::Duration::from_secs(config.http.header_timeout.max(1)),
        idle_timeout: std::time::Duration::from_secs(config.http.idle_timeout.max(1)),
        max_connections: crate::http::listener::connection_cap(
            config.http.max_connections,
            fd_limit,
            headroom,
        ),
    }
}

/// The image server's TLS (`[http]tls_*`) and Basic authentication
/// (`[deploy]image_server_*`); a certificate that does not load stops the
/// start.
fn image_server_security(config: &Config, metrics: &Metrics) -> Result<http::Security> {
    let tls = if config.tls_enabled() {
        let files = http::tls::TlsFiles {
            cert: config.http.tls_cert_file.clone().into(),
            key: config.http.tls_key_file.clone().into(),
            min_version: http::tls::MinVersion::parse(&config.http.tls_min_version)
                .unwrap_or(http::tls::MinVersion::Tls13),
        };
        let tls = http::Tls::load(files, Some(metrics.http.tls_reloads.clone()))
            .map_err(|e| Error::new(ErrorCode::Internal, format!("configuration: {e}")))?;
        Some(Arc::new(tls))
    } else {
        None
    };
    let d = &config.deploy;
    let auth = (d.image_server_auth_strategy == "http_basic")
        .then(|| http::BasicAuth::new(&d.image_server_user, &d.image_server_password));
    Ok(http::Security { tls, auth })
}

/// How the image server logs its requests (`[log]access_log`, `format`).
fn access_log(config: &Config) -> http::AccessLog {
    match (config.log.access_log, config.log.format) {
        (false, _) => http::AccessLog::Off,
        (true, crate::config::LogFormat::Text) => http::AccessLog::Combined,
        (true, crate::config::LogFormat::Json) => http::AccessLog::Json,
    }
}

/// Listens on `addr`, the value of `option`; an error names both.
async fn bind(option: &str, addr: std::net::SocketAddr) -> Result<TcpListener> {
    let listener = TcpListener::bind(addr).await.map_err(|e| {
        Error::new(
            ErrorCode::Internal,
            format!("{option} {addr}: cannot listen: {e}"),
        )
    })?;
    if let Ok(bound) = listener.local_addr() {
        crate::sources::http_client::note_listener(bound);
    }
    Ok(listener)
}

/// Completes on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
