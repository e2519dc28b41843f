package membership_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ftcomm/ftcomm/membership"
)

// A client made by ClientConfig logs no line per retried call, even to a
// debug logger, while etcd is away: a trainer's log shows what it waits
// for, not one or two lines per attempt of every call.
func TestClientLogsNoRetryLines(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	away := l.Addr().String()
	l.Close()
	core, logs := observer.New(zapcore.DebugLevel)
	cli, err := clientv3.New(membership.ClientConfig([]string{away}, zap.New(core)))
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	if _, err := cli.Get(ctx, "k"); err == nil {
		t.Fatal("a Get from no etcd succeeded")
	}
	for _, e := range logs.All() {
		if e.Level < zapcore.InfoLevel || strings.Contains(e.Message, "retrying") {
			t.Errorf("the client logged %s %q", e.Level, e.Message)
		}
	}
}
