package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

func main() { os.Exit(realMain()) }

func realMain() int {
	if spec, ok := os.LookupEnv(workerEnv); ok {
		return workerProcess(spec)
	}
	cfg, err := parseFlags(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if !slices.Contains(comm.Backends(), cfg.Backend) {
		fmt.Fprintf(os.Stderr, "ftbench: unknown backend %q (this build has: %s)\n", cfg.Backend, strings.Join(comm.Backends(), ", "))
		return 2
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(os.Stderr, "ftbench: find own binary to start workers: %v\n", err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	l := &launcher{cfg: cfg, args: os.Args, exe: exe, out: os.Stdout, diag: os.Stderr,
		stall: time.Duration(cfg.Timeout) + 30*time.Second}
	s, err := l.run(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if !s.OK {
		fmt.Fprintf(os.Stderr, "ftbench: %d wrong elements\n", s.Wrong)
		return 1
	}
	return 0
}

// workerProcess is the entry of a worker process. It stops when its stdin
// (a pipe from the launcher) reaches EOF or on SIGTERM/SIGINT, and exits
// at the latest 5 s after that even if an op is stuck.
func workerProcess(specJSON string) int {
	var spec workerSpec
	if err := json.Unmarshal([]byte(specJSON), &spec); err != nil {
		fmt.Fprintf(os.Stderr, "ftbench: worker: bad %s: %v\n", workerEnv, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() { // exits with the process; its read ends at the launcher's exit at the latest
		io.Copy(io.Discard, os.Stdin)
		cancel(errors.New("ftbench: the launcher went away"))
	}()
	context.AfterFunc(ctx, func() {
		time.AfterFunc(5*time.Second, func() {
			fmt.Fprintf(os.Stderr, "ftbench: rank %d: still running 5 s after %v; exiting\n", spec.Rank, context.Cause(ctx))
			os.Exit(3)
		})
	})
	return workerMain(ctx, spec, os.Stdout, os.Stderr)
}
