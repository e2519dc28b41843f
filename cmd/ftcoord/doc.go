// Command ftcoord is the ftcomm coordinator service: it forms and publishes
// the quorums of every job (package membership), and serves a JSON API, a
// live dashboard, Prometheus metrics and a health check.
//
//	ftcoord serve                          # embedded single-node etcd in ./ftcoord-data
//	ftcoord serve -etcd h1:2379,h2:2379    # an external etcd cluster; run several for failover
//	ftcoord status -addr http://host:8080 [-job J]
//
// Several instances on one etcd elect one leader; the others answer the
// API from etcd and take over when the leader dies (after -session-ttl).
// SIGTERM or SIGINT shuts an instance down gracefully: it resigns
// leadership, finishes HTTP requests and stops its embedded etcd.
//
// HTTP (JSON unless noted; with -token, everything but / and /healthz
// wants "Authorization: Bearer <token>"):
//
//	GET  /                                       dashboard (HTML)
//	GET  /healthz                                200 when etcd answers
//	GET  /metrics                                Prometheus
//	GET  /api/v1/coordinator                     this instance and the leader
//	GET  /api/v1/jobs                            jobs with epoch and counts
//	GET  /api/v1/jobs/{job}                      quorum, members, revocations, why waiting
//	GET  /api/v1/jobs/{job}/members              members
//	GET  /api/v1/jobs/{job}/quorum               current quorum (404 when none)
//	GET  /api/v1/jobs/{job}/history?limit=N      past quorums, newest first
//	POST /api/v1/jobs/{job}/members/{id}/evict   body optional: {"by": …, "reason": …}
//
// The service itself is package server (cmd/ftcoord/server), so that
// another program can run an embedded ftcoord with its dashboard in
// process; this command adds flags, signals and the status CLI.
//
// Errors are {"error": "…"} with 400 (bad input), 401 (token), 404 (no such
// job, member or endpoint) or 503 (etcd unavailable). Every flag can be set
// by an environment variable FTCOORD_<FLAG>; invalid configuration makes
// ftcoord say what is wrong and exit with status 2.
package main
