package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

const usage = `ftcoord: the ftcomm coordinator service.

Usage:
  ftcoord serve       [flags]   run a coordinator (embedded etcd by default)
  ftcoord status      [flags]   print jobs, or one job with -job, as tables
  ftcoord job new-run [flags] <job>   start a new run of a job: its trainers start from step 0
  ftcoord job set [flags] <job> key=value…   change a running job's settings (key:type=value, -key to unset)
  ftcoord credentials [flags]   print the trainers' credentials file that serve wrote
  ftcoord version               print the version (also: ftcoord --version)

Setting up an external etcd (see docs/deploy.md):
  ftcoord certs       [flags]   make a CA and etcd's server and client certificates
  ftcoord secrets     [flags]   make the coordinators' shared keys (quorum signing, gossip)
  ftcoord etcd-init   [flags]   create ftcomm's etcd users and roles and turn auth on (as root)

Every flag can also be set by environment variable: FTCOORD_<FLAG>, upper
case with '-' as '_' (e.g. FTCOORD_DATA_DIR, FTCOORD_TOKEN). A flag on the
command line wins. "ftcoord <command> -h" lists a command's flags with
their variables.
`

func main() {
	for _, name := range unknownEnv(os.Environ()) {
		fmt.Fprintf(os.Stderr, "ftcoord: warning: $%s sets no flag of any command (a typo?); ignored\n", name)
	}
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// unknownEnv returns the FTCOORD_ variables of environ that set no flag
// of any command: a misspelt variable in a manifest is otherwise silently
// ignored.
func unknownEnv(environ []string) []string {
	known := map[string]bool{}
	for _, mk := range commands() {
		fs := flag.NewFlagSet("", flag.ContinueOnError)
		mk().flags(fs)
		fs.VisitAll(func(f *flag.Flag) { known[envName(f.Name)] = true })
	}
	var out []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(name, "FTCOORD_") && !known[name] {
			out = append(out, name)
		}
	}
	return out
}

// newFlagSet makes the flag set of a command: its flags, each usage
// naming its environment variable, and a usage line.
func newFlagSet(cmd, args string, register func(*flag.FlagSet)) *flag.FlagSet {
	fs := flag.NewFlagSet("ftcoord "+cmd, flag.ContinueOnError)
	register(fs)
	showEnv(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: ftcoord %s %s\n\nFlags (a flag on the command line wins over its $FTCOORD_… variable):\n", cmd, args)
		fs.PrintDefaults()
	}
	return fs
}

func newServeFlagSet(cfg *serveConfig) *flag.FlagSet {
	return newFlagSet("serve", "[flags]", cfg.flags)
}

// command is one subcommand: its flags, and what it does once they are
// parsed (ctx ends at SIGTERM or SIGINT).
type command struct {
	args  string
	flags func(*flag.FlagSet)
	check func() error
	run   func(ctx context.Context, stdout, stderr io.Writer) error
	// positional takes the arguments after the flags (nil: none allowed).
	positional func([]string) error
}

func commands() map[string]func() command {
	return map[string]func() command{
		"serve": func() command {
			cfg := defaultServeConfig()
			return command{"[flags]", cfg.flags, cfg.validate, func(ctx context.Context, _, stderr io.Writer) error { return serve(ctx, cfg, stderr) }, nil}
		},
		"status": func() command {
			var cfg statusConfig
			return command{"[flags]", cfg.flags, cfg.validate, func(ctx context.Context, stdout, _ io.Writer) error { return status(ctx, cfg, stdout) }, nil}
		},
		"job new-run": func() command {
			var cfg newRunConfig
			return command{"[flags] <job>", cfg.flags, cfg.validate, func(ctx context.Context, stdout, _ io.Writer) error { return newRun(ctx, cfg, stdout) }, cfg.setJob}
		},
		"job set": func() command {
			var cfg setConfig
			return command{"[flags] <job> key=value|key:type=value|-key …", cfg.flags, cfg.validate,
				func(ctx context.Context, stdout, _ io.Writer) error { return setSettings(ctx, cfg, stdout) }, cfg.setArgs}
		},
		"credentials": func() command {
			cfg := defaultCredentialsConfig()
			return command{"[flags]", cfg.flags, cfg.validate, func(_ context.Context, stdout, _ io.Writer) error { return cfg.print(stdout) }, nil}
		},
		"certs": func() command {
			cfg := defaultCertsConfig()
			return command{"[flags]", cfg.flags, cfg.validate, func(_ context.Context, stdout, _ io.Writer) error { return cfg.make(stdout) }, nil}
		},
		"secrets": func() command {
			cfg := defaultSecretsConfig()
			return command{"[flags]", cfg.flags, cfg.validate, func(_ context.Context, stdout, _ io.Writer) error { return cfg.make(stdout) }, nil}
		},
		"etcd-init": func() command {
			cfg := defaultEtcdInitConfig()
			return command{"[flags]", cfg.flags, cfg.validate, func(ctx context.Context, stdout, _ io.Writer) error { return cfg.init(ctx, stdout) }, nil}
		},
	}
}

// run executes a command line and returns the process exit code: 0 done,
// 1 failed, 2 invalid usage or configuration.
func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	case "version", "-version", "--version":
		fmt.Fprintln(stdout, currentBuild())
		return 0
	}
	name, rest := args[0], args[1:]
	if name == "job" && len(rest) > 0 { // a group of commands: "job new-run"
		name, rest = name+" "+rest[0], rest[1:]
	}
	mk, ok := commands()[name]
	if !ok {
		fmt.Fprintf(stderr, "ftcoord: unknown command %q\n\n%s", name, usage)
		return 2
	}
	c := mk()
	fs := newFlagSet(name, c.args, c.flags)
	fs.SetOutput(stderr)
	if err := parseFlags(fs, rest, getenv); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		fmt.Fprintf(stderr, "ftcoord %s: %v\n", name, err)
		return 2
	}
	if c.positional != nil {
		if err := c.positional(fs.Args()); err != nil {
			fmt.Fprintf(stderr, "ftcoord %s: %v\n", name, err)
			return 2
		}
	} else if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "ftcoord %s: unexpected arguments %q\n", name, fs.Args())
		return 2
	}
	if err := c.check(); err != nil {
		fmt.Fprintf(stderr, "ftcoord %s: %v\n", name, err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := c.run(ctx, stdout, stderr); err != nil {
		fmt.Fprintf(stderr, "ftcoord %s: %v\n", name, err)
		return 1
	}
	return 0
}
