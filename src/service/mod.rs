//! `serve`: the long-running worker. Starts the image server, the metrics
//! listener and the broker consumer, and runs until SIGTERM/SIGINT.
//!
//! # This folder
//!
//! Holds `serve` (starts the image server, the operations listener, the
//! broker consumer and housekeeping; stops them on SIGTERM) and systemd
//! readiness (`sd_notify`). Must not know the pipeline's internals.

pub(crate) mod sd_notify;

use crate::config::{AuthStrategy, Config, TlsMinVersion};
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
    let (stop_tx, stop_rx) = watch::channel(false);
    let running = start(config, files, stop_rx).await?;
    // Images are served from here on; the broker connection (which may come
    // later, with retries) is reported by /readyz, not by systemd.
    crate::service::sd_notify::notify("READY=1\nSTATUS=serving images; broker state on /readyz");
    shutdown_signal().await;
    crate::service::sd_notify::notify("STOPPING=1");
    tracing::info!("shutting down: finishing in-flight work, giving back work not started");
    running.work.stop_taking();
    let _ = stop_tx.send(true);
    running.stop().await;
    tracing::info!("stopped");
    Ok(())
}

/// What `serve` started, stopped in order once `stop` is raised.
struct Running {
    /// The broker consumer, when `[amqp]enabled`.
    consumer: Option<tokio::task::JoinHandle<()>>,
    /// The work both transports hand in (drained here without a broker).
    work: Arc<crate::dispatch::Dispatch>,
    /// `[amqp]shutdown_grace`.
    grace: std::time::Duration,
    housekeeping: tokio::task::JoinHandle<()>,
    /// The image, operations, peer and JSON-RPC listeners.
    servers: Vec<Server>,
}

impl Running {
    /// Lets in-flight work finish (the consumer's own grace, or the
    /// dispatch drained), then stops housekeeping and the listeners.
    async fn stop(self) {
        match self.consumer {
            Some(consumer) => drop(consumer.await),
            None => drain(&self.work, self.grace).await,
        }
        let _ = self.housekeeping.await;
        stop_servers(self.servers).await;
    }
}

/// Binds the listeners (first: a worker that cannot, a port in use, stops
/// before it makes or changes anything on disk), recovers the pipeline and
/// starts everything `serve` runs, each stopping when `stop` is raised.
async fn start(config: Config, files: &str, stop: watch::Receiver<bool>) -> Result<Running> {
    let metrics = Arc::new(Metrics::new());
    metrics.amqp.enabled.set(i64::from(config.amqp.enabled));
    let limits = image_server_limits(&config);
    let security = image_server_security(&config, &metrics)?;
    let settings = crate::broker::Settings::of(&config)?;
    let brokers = (config.amqp.enabled)
        .then(|| crate::broker::Brokers::new(&settings.amqp))
        .transpose()?;
    let listeners = Listeners::bind(&config).await?;
    let (pipeline, roots) = start_pipeline(&config, &metrics)?;
    announce(&config, limits, &security, files);
    let connected = brokers
        .is_some()
        .then(|| Arc::new(std::sync::atomic::AtomicBool::new(false)));
    let images = tokio::spawn(http::serve_images(
        listeners.images,
        roots,
        metrics.clone(),
        (limits, security, access_log(&config)),
        stopped(stop.clone()),
    ));
    let ops = tokio::spawn(http::serve_ops(
        listeners.ops,
        metrics.clone(),
        health_of(&config, connected.as_ref()),
        limits,
        stopped(stop.clone()),
    ));
    let peers = spawn_peer_listener(&config, &pipeline, &metrics, limits, &stop).await?;
    start_peer_link(&config, &settings, &pipeline, &metrics, &stop)?;
    let bounds = crate::dispatch::Bounds {
        host: settings.host.clone(),
        prefetch: settings.amqp.prefetch,
        slow_downloads: settings.slow_downloads,
    };
    let work = Arc::new(crate::dispatch::Dispatch::new(
        pipeline.clone(),
        metrics.clone(),
        bounds,
    ));
    let rpc = spawn_json_rpc(listeners.rpc, &work, &config, &metrics, &stop)?;
    let grace = std::time::Duration::from_secs(settings.amqp.shutdown_grace);
    let consumer = brokers.zip(connected).map(|(brokers, connected)| {
        tokio::spawn(crate::broker::run(
            work.clone(),
            settings,
            brokers,
            connected,
            stop.clone(),
        ))
    });
    let housekeeping = tokio::spawn(housekeeping(pipeline, config.cache.clean_interval, stop));
    let servers = [Some(images), Some(ops), peers, rpc].into_iter().flatten();
    Ok(Running {
        consumer,
        work,
        grace,
        housekeeping,
        servers: servers.collect(),
    })
}

/// The pipeline, recovered from what a previous process left (and
/// compressing masters in the background), and the directories the image
/// server serves from.
fn start_pipeline(config: &Config, metrics: &Arc<Metrics>) -> Result<(Arc<Pipeline>, ImageRoots)> {
    let pipeline = Arc::new(Pipeline::new(config.clone(), metrics.clone())?);
    pipeline.recover()?;
    pipeline.masters().start_compressing();
    let roots = ImageRoots::new(
        &config.deploy.http_root,
        &[&config.pxe.instance_master_path, &config.pxe.images_path],
    )
    .map_err(|e| Error::io("resolve served directories", e))?
    .with_gzip(pipeline.masters().gzip_dir());
    Ok((pipeline, roots))
}

/// The listeners `serve` binds before it touches anything on disk.
struct Listeners {
    /// `[http]listen`: the image server.
    images: TcpListener,
    /// `[metrics]listen`: `/metrics`, `/healthz`, `/readyz`.
    ops: TcpListener,
    /// `[json_rpc]listen`, when set.
    rpc: Option<(std::net::SocketAddr, TcpListener)>,
}

impl Listeners {
    /// Binds every configured listener; an error names the option.
    async fn bind(config: &Config) -> Result<Listeners> {
        let images = bind("[http]listen", config.http.listen).await?;
        let ops = bind("[metrics]listen", config.metrics.listen).await?;
        let rpc = match config.json_rpc.listen {
            Some(addr) => Some((addr, bind("[json_rpc]listen", addr).await?)),
            None => None,
        };
        Ok(Listeners { images, ops, rpc })
    }
}

/// Completes once `stop` turns true.
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A listener's task, ending when it stopped serving.
type Server = tokio::task::JoinHandle<std::io::Result<()>>;

/// Without a broker: lets the work under way finish within `grace`
/// (`[amqp]shutdown_grace`; the broker's consumer does it otherwise).
async fn drain(work: &crate::dispatch::Dispatch, grace: std::time::Duration) {
    work.tracker.close();
    if tokio::time::timeout(grace, work.tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            ?grace,
            "work under way did not finish in the grace period; its callers ask again"
        );
    }
}

/// Starts the JSON-RPC listener on `listener` (bound when
/// `[json_rpc]listen` is set).
fn spawn_json_rpc(
    listener: Option<(std::net::SocketAddr, TcpListener)>,
    work: &Arc<crate::dispatch::Dispatch>,
    config: &Config,
    metrics: &Metrics,
    stop: &watch::Receiver<bool>,
) -> Result<Option<Server>> {
    let Some((listen, listener)) = listener else {
        return Ok(None);
    };
    let c = &config.json_rpc;
    let configuration = |e: String| Error::new(ErrorCode::Internal, format!("configuration: {e}"));
    let auth = (c.auth_strategy == AuthStrategy::HttpBasic)
        .then(|| crate::rpc::htpasswd::Htpasswd::open(c.http_basic_auth_user_file.clone().into()))
        .transpose()
        .map_err(|e| configuration(format!("[json_rpc]http_basic_auth_user_file {e}")))?
        .map(Arc::new);
    let tls = c
        .tls_enabled()
        .then(|| {
            let files = http::tls::TlsFiles {
                cert: c.tls_cert_file.clone().into(),
                key: c.tls_key_file.clone().into(),
                min_version: min_version(c.tls_min_version),
            };
            http::Tls::load(files, Some(metrics.http.tls_reloads.clone()))
        })
        .transpose()
        .map_err(|e| configuration(format!("[json_rpc]tls_cert_file: {e}")))?
        .map(Arc::new);
    let limits = http::Limits {
        max_connections: c.max_connections,
        slow_handlers: true,
        ..image_server_limits(config)
    };
    tracing::info!(json_rpc = %listen, auth = %c.auth_strategy, tls = tls.is_some(), "serving JSON-RPC");
    let server = crate::rpc::RpcServer {
        work: work.clone(),
        auth,
        tls,
        limits,
        max_body_bytes: c.max_body_bytes,
        request_timeout: std::time::Duration::from_secs(c.request_timeout),
    };
    Ok(Some(tokio::spawn(crate::rpc::serve(
        listener,
        server,
        stopped(stop.clone()),
    ))))
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
        next = match config.amqp.enabled {
            true => "check `ironic-image-worker config show`; try `ironic-image-worker send \
                     prepare --node <uuid> --image-source <url> --wait`; /readyz on the metrics \
                     address says when the broker is connected",
            false => "check `ironic-image-worker config show`; commands come through \
                      [json_rpc]listen (no broker); /readyz on the metrics address says when \
                      the worker is ready",
        },
        "ironic-image-worker serving"
    );
}

/// Waits for the listeners to finish: downloads by nodes may last long, so
/// they get a moment, then stop.
async fn stop_servers(servers: Vec<Server>) {
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
/// it to the pipeline with the peer fetcher `config` sets up, so a miss
/// asks the other workers first.
fn start_peer_link(
    config: &Config,
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
        let fetcher = crate::sources::peer::PeerFetcher::new(config)?;
        pipeline.masters().enable_peers(link, fetcher);
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
    stop: &watch::Receiver<bool>,
) -> Result<Option<Server>> {
    let (Some(listen), true) = (config.peers.listen, config.peers.enabled()) else {
        return Ok(None);
    };
    let server = http::peers::PeerServer {
        masters: config.pxe.instance_master_path.clone(),
        secret: config.peers.load_secret()?,
        max_uploads: config.peers.max_uploads,
        live: pipeline.masters().live_masters(),
        gzip: pipeline.masters().gzip_dir(),
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
        stopped(stop.clone()),
    ))))
}

/// What `/readyz` checks: the directories the worker writes, and the broker
/// connection the consumer reports in `connected` (none without a broker).
fn health_of(config: &Config, connected: Option<&Arc<std::sync::atomic::AtomicBool>>) -> Health {
    Health {
        dirs: vec![
            config.pxe.instance_master_path.clone(),
            config.pxe.images_path.clone(),
            config
                .deploy
                .http_root
                .join(&config.deploy.http_image_subdir),
        ],
        broker: connected.cloned(),
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
        slow_handlers: false,
    }
}

/// The image server's TLS (`[http]tls_*`) and Basic authentication
/// (`[http]auth_*`); a certificate that does not load stops the start.
fn image_server_security(config: &Config, metrics: &Metrics) -> Result<http::Security> {
    let tls = if config.tls_enabled() {
        let files = http::tls::TlsFiles {
            cert: config.http.tls_cert_file.clone().into(),
            key: config.http.tls_key_file.clone().into(),
            min_version: min_version(config.http.tls_min_version),
        };
        let tls = http::Tls::load(files, Some(metrics.http.tls_reloads.clone()))
            .map_err(|e| Error::new(ErrorCode::Internal, format!("configuration: {e}")))?;
        Some(Arc::new(tls))
    } else {
        None
    };
    let h = &config.http;
    let auth = (h.auth_strategy == AuthStrategy::HttpBasic)
        .then(|| http::BasicAuth::new(&h.auth_user, &h.auth_password));
    Ok(http::Security { tls, auth })
}

/// The image server's name for a `tls_min_version` of the configuration.
fn min_version(configured: TlsMinVersion) -> http::tls::MinVersion {
    match configured {
        TlsMinVersion::Tls12 => http::tls::MinVersion::Tls12,
        TlsMinVersion::Tls13 => http::tls::MinVersion::Tls13,
    }
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
