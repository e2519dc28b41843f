package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// sampleEtcd reads what -etcd-stats prints from a member's /metrics in
// Prometheus' text format: gauges, counters and a histogram's sum and
// count; a metric it does not know is skipped, and a page that is not
// metrics is an error.
func TestSampleEtcd(t *testing.T) {
	page := `# HELP etcd_server_is_leader Whether or not this member is a leader.
# TYPE etcd_server_is_leader gauge
etcd_server_is_leader 1
# TYPE etcd_server_proposals_committed_total gauge
etcd_server_proposals_committed_total 1200
# TYPE etcd_server_proposals_applied_total gauge
etcd_server_proposals_applied_total 1150
# TYPE etcd_debugging_mvcc_slow_watcher_total gauge
etcd_debugging_mvcc_slow_watcher_total 42
# TYPE etcd_debugging_lease_revoked_total counter
etcd_debugging_lease_revoked_total 7
# TYPE etcd_mvcc_db_total_size_in_use_in_bytes gauge
etcd_mvcc_db_total_size_in_use_in_bytes 3.145728e+06
# TYPE etcd_disk_wal_fsync_duration_seconds histogram
etcd_disk_wal_fsync_duration_seconds_bucket{le="0.001"} 3
etcd_disk_wal_fsync_duration_seconds_bucket{le="+Inf"} 4
etcd_disk_wal_fsync_duration_seconds_sum 0.008
etcd_disk_wal_fsync_duration_seconds_count 4
# TYPE something_else counter
something_else 99
`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte(page))
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	s, err := sampleEtcd(context.Background(), addr)
	if err != nil {
		t.Fatal(err)
	}
	want := etcdSample{leader: true, committed: 1200, applied: 1150, slowWatchers: 42, revoked: 7, dbInUseMB: 3,
		fsyncSum: 0.008, fsyncCount: 4}
	if s != want {
		t.Fatalf("sample %+v, want %+v", s, want)
	}

	bad := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("<html>not metrics</html>\n"))
	}))
	defer bad.Close()
	if _, err := sampleEtcd(context.Background(), strings.TrimPrefix(bad.URL, "http://")); err == nil {
		t.Fatal("a page that is not metrics: no error")
	}
}
