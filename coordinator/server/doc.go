// Package server is the ftcomm coordinator service that `ftcoord serve`
// runs, importable so that another program can run one in process (a
// demo, a test, a launcher): etcd (embedded single node by default, or a
// client of an external cluster), a coordinator.Coordinator, and an HTTP
// server with the JSON API, the live dashboard, Prometheus /metrics and
// /healthz (see cmd/ftcoord's documentation for the endpoints).
//
// # Lifecycle
//
//	cfg := server.DefaultConfig()
//	cfg.DataDir, cfg.Listen = dir, "127.0.0.1:0"
//	s, err := server.New(ctx, cfg)   // etcd up, listener bound, credentials written
//	fmt.Println(s.DashboardURL())
//	// trainers: ft.Config{Credentials: s.CredentialsPath(), …} (or FTCOMM_CREDENTIALS)
//	err = s.Serve(ctx)                // until ctx ends or Close; then a graceful stop
//
// New starts etcd and binds the HTTP listener, so URL, DashboardURL,
// Endpoints and CredentialsPath are known before Serve. DefaultConfig is
// secure, as `ftcoord serve` (see its documentation): the embedded etcd
// wants TLS client certificates and etcd roles, quorums are signed, gossip
// is encrypted, and CredentialsPath is the one file trainers need.
// Config.Insecure turns that off for experiments. Serve runs the coordinator (campaign,
// lead, publish) and the HTTP server until ctx ends or Close is called,
// then shuts down within Config.ShutdownTimeout: it resigns leadership
// (a standby takes over at once), finishes HTTP requests, closes its etcd
// client and stops the embedded etcd. Close stops a running Serve and
// waits for it, or releases what New started when Serve never ran; it is
// safe to call twice and from any goroutine.
//
// # Concurrency
//
// A Server's methods are safe for concurrent use. Serve's goroutines (the
// coordinator's, the HTTP server's) have exited when it returns. The
// Prometheus registry is the server's own: two servers in one process do
// not share metrics.
package server
