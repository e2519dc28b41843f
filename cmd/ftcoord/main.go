package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

const usage = `ftcoord: the ftcomm coordinator service.

Usage:
  ftcoord serve  [flags]   run a coordinator (embedded etcd by default)
  ftcoord status [flags]   print jobs, or one job with -job, as tables

Every flag can also be set by environment variable: FTCOORD_<FLAG>, upper
case with '-' as '_' (e.g. FTCOORD_DATA_DIR, FTCOORD_TOKEN). A flag on the
command line wins. Run "ftcoord serve -h" for the flags of a command.
`

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

func newServeFlagSet(cfg *serveConfig) *flag.FlagSet {
	fs := flag.NewFlagSet("ftcoord serve", flag.ContinueOnError)
	cfg.flags(fs)
	return fs
}

// run executes a command line and returns the process exit code: 0 done,
// 1 failed, 2 invalid usage or configuration.
func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "serve":
		cfg := defaultServeConfig()
		fs := newServeFlagSet(&cfg)
		fs.SetOutput(stderr)
		if err := parseFlags(fs, args[1:], getenv); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return 0
			}
			fmt.Fprintf(stderr, "ftcoord serve: %v\n", err)
			return 2
		}
		if fs.NArg() > 0 {
			fmt.Fprintf(stderr, "ftcoord serve: unexpected arguments %q\n", fs.Args())
			return 2
		}
		if err := cfg.validate(); err != nil {
			fmt.Fprintf(stderr, "ftcoord serve: %v\n", err)
			return 2
		}
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		defer stop()
		if err := serve(ctx, cfg, stderr); err != nil {
			fmt.Fprintf(stderr, "ftcoord serve: %v\n", err)
			return 1
		}
		return 0
	case "status":
		fs := flag.NewFlagSet("ftcoord status", flag.ContinueOnError)
		fs.SetOutput(stderr)
		var cfg statusConfig
		cfg.flags(fs)
		if err := parseFlags(fs, args[1:], getenv); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return 0
			}
			fmt.Fprintf(stderr, "ftcoord status: %v\n", err)
			return 2
		}
		if err := cfg.validate(); err != nil {
			fmt.Fprintf(stderr, "ftcoord status: %v\n", err)
			return 2
		}
		if err := status(context.Background(), cfg, stdout); err != nil {
			fmt.Fprintf(stderr, "ftcoord status: %v\n", err)
			return 1
		}
		return 0
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	default:
		fmt.Fprintf(stderr, "ftcoord: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
}
