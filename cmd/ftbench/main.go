package main

import (
	"bufio"
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
	if _, ok := os.LookupEnv(workerEnv); ok {
		return workerProcess(os.Stdin)
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

// workerProcess is the entry of a worker process. It reads its workerSpec
// from the first line of stdin (a pipe from the launcher), stops when
// stdin reaches EOF or on SIGTERM/SIGINT, and exits at the latest 5 s
// after that even if an op is stuck.
func workerProcess(stdin io.Reader) int {
	br := bufio.NewReader(stdin)
	line, err := br.ReadBytes('\n')
	var spec workerSpec
	if err == nil {
		err = json.Unmarshal(line, &spec)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "ftbench: worker: no valid spec on stdin (run ftbench without %s): %v\n", workerEnv, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	go func() { // exits with the process; its read ends at the launcher's exit at the latest
		io.Copy(io.Discard, br)
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
