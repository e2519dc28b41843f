package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/etcdhost"
)

// etcdEnv, when set to an etcdSpec in JSON, makes this program an etcd
// server (the external etcd of the "cluster" topology, which the nemesis
// restarts on its data directory).
const etcdEnv = "FTCOMM_CHAOS_ETCD"

type etcdSpec struct {
	Dir        string
	ClientAddr string
	PeerAddr   string
}

// runEtcd serves until SIGTERM or its stdin closes, printing "ready" once
// clients may connect.
func runEtcd(specJSON string) int {
	var spec etcdSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "etcd: spec:", err)
		return 2
	}
	log, _ := zap.NewProduction()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ec := etcdhost.DefaultEmbeddedConfig()
	ec.Dir, ec.Name, ec.ClientAddr, ec.PeerAddr, ec.Logger = spec.Dir, "chaos-etcd", spec.ClientAddr, spec.PeerAddr, log
	e, err := etcdhost.StartEmbedded(ctx, ec)
	if err != nil {
		fmt.Fprintln(os.Stderr, "etcd:", err)
		return 1
	}
	fmt.Println("ready")
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	gone := make(chan struct{})
	go func() { io.Copy(io.Discard, os.Stdin); close(gone) }()
	select {
	case <-stop:
	case <-gone:
	}
	if err := e.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "etcd: close:", err)
		return 1
	}
	return 0
}
