package main

// The coordinator service (package coordinator/server) run in this
// process, for examples and tests that need no cluster.

/*
#include <stdint.h>
*/
import "C"

import (
	"context"
	"errors"
	"os"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/ftcomm/ftcomm/coordinator/server"
	"github.com/ftcomm/ftcomm/membership"
)

// coordSettings are ftcomm_coordinator_start's settings (JSON).
type coordSettings struct {
	DataDir      string  `json:"data_dir"` // default: a temporary folder, removed at free
	Listen       string  `json:"listen"`   // API and dashboard; default 127.0.0.1:0
	Insecure     bool    `json:"insecure"`
	JoinTimeoutS float64 `json:"join_timeout_s"`
	SessionTTLS  float64 `json:"session_ttl_s"`
	MinReplicas  int     `json:"min_replicas"`
	Gossip       bool    `json:"gossip"`
	Fsync        bool    `json:"fsync"` // default off: a coordinator for tests and examples
	LogLevel     string  `json:"log_level"`
}

// coordObj is what a coordinator handle names: an ftcoord service
// (embedded etcd, coordinator, API) running in this process.
type coordObj struct {
	srv  *server.Server
	dir  string // removed at free when the ABI made it
	stop context.CancelFunc
	done chan error
	log  *zap.Logger
	Info coordInfo
}

type coordInfo struct {
	Endpoints   []string `json:"endpoints"`
	Credentials string   `json:"credentials"`
	URL         string   `json:"url"`
	Dashboard   string   `json:"dashboard"`
	DataDir     string   `json:"data_dir"`
}

// ftcomm_coordinator_start starts an ftcoord service in this process, as
// `ftcoord serve` runs it (secure unless insecure is set; trainers find
// their credentials at the path ftcomm_coordinator_info reports), and
// returns its handle once it serves.
//
//export ftcomm_coordinator_start
func ftcomm_coordinator_start(settings *C.char, out *C.uint64_t) C.int32_t {
	return guard(func() error {
		var s coordSettings
		if err := decode(goString(settings), &s); err != nil {
			return err
		}
		log, err := newLogger(s.LogLevel, "ftcoord")
		if err != nil {
			return err
		}
		dir, own := s.DataDir, false
		if dir == "" {
			if dir, err = os.MkdirTemp("", "ftcoord-"); err != nil {
				return err
			}
			own = true
		}
		cfg := server.DefaultConfig()
		cfg.Listen, cfg.DataDir, cfg.UnsafeNoFsync, cfg.Insecure = "127.0.0.1:0", dir, !s.Fsync, s.Insecure
		if s.Listen != "" {
			cfg.Listen = s.Listen
		}
		cfg.Quorum.JoinTimeout, cfg.SessionTTL, cfg.ShutdownTimeout = 500*time.Millisecond, 2*time.Second, 5*time.Second
		if s.JoinTimeoutS > 0 {
			cfg.Quorum.JoinTimeout = seconds(s.JoinTimeoutS)
		}
		if s.SessionTTLS > 0 {
			cfg.SessionTTL = seconds(s.SessionTTLS)
		}
		if s.MinReplicas > 0 {
			cfg.Quorum.MinReplicas = s.MinReplicas
		}
		if s.Gossip {
			g := membership.DefaultGossipConfig()
			cfg.Gossip = &g
		} else {
			cfg.Gossip = nil
		}
		cfg.Logger = log
		can := newCanceler()
		defer can.release()
		ctx := can.enter()
		defer can.leave()
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		srv, err := server.New(ctx, cfg)
		if err != nil {
			if own {
				os.RemoveAll(dir)
			}
			return interrupted(ctx, err)
		}
		rctx, stop := context.WithCancel(context.Background())
		o := &coordObj{srv: srv, stop: stop, done: make(chan error, 1), log: log,
			Info: coordInfo{Endpoints: srv.Endpoints(), Credentials: srv.CredentialsPath(), URL: srv.URL(),
				Dashboard: srv.DashboardURL(), DataDir: dir}}
		if own {
			o.dir = dir
		}
		go func() { o.done <- srv.Serve(rctx) }() // exits at free
		*out = C.uint64_t(abi.put(o))
		return nil
	})
}

// ftcomm_coordinator_info copies {endpoints, credentials, url, dashboard,
// data_dir} (JSON) into buf.
//
//export ftcomm_coordinator_info
func ftcomm_coordinator_info(h C.uint64_t, buf unsafe.Pointer, capacity C.int64_t, n *C.int64_t) C.int32_t {
	return guard(func() error {
		o, err := lookup[*coordObj](uint64(h))
		if err != nil {
			return err
		}
		return putJSON(o.Info, buf, capacity, n)
	})
}

// ftcomm_coordinator_free stops the service (and removes its data folder
// if the ABI made it) and frees the handle.
//
//export ftcomm_coordinator_free
func ftcomm_coordinator_free(h C.uint64_t) C.int32_t {
	return guard(func() error {
		o, err := take[*coordObj](uint64(h))
		if err != nil {
			return err
		}
		o.stop()
		err = <-o.done
		if errors.Is(err, context.Canceled) {
			err = nil
		}
		err = errors.Join(err, o.srv.Close())
		if o.dir != "" {
			err = errors.Join(err, os.RemoveAll(o.dir))
		}
		o.log.Sync()
		return err
	})
}
