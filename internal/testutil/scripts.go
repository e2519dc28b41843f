package testutil

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// RunScripts runs every script that pattern matches as a subtest named
// for its file: the form of the module's pure machines' tests (ft's step
// machine, the coordinator's and the quorum rules). A script is lines;
// "> cmd" is a command, and the lines after it up to a blank line, a
// comment ("#…") or the next command are its expected output. Each script
// gets a fresh runner from start, which answers one command with its
// output lines (it may fail the test). With rewrite the scripts are
// written back with the outputs got, for a deliberate change; review the
// diff.
func RunScripts(t *testing.T, pattern string, rewrite bool, start func(t *testing.T) func(cmd string) []string) {
	t.Helper()
	files, err := filepath.Glob(pattern)
	if err != nil || len(files) == 0 {
		t.Fatalf("no scripts match %s: %v", pattern, err)
	}
	for _, file := range files {
		t.Run(strings.TrimSuffix(filepath.Base(file), ".txt"), func(t *testing.T) {
			runScript(t, file, rewrite, start(t))
		})
	}
}

func runScript(t *testing.T, file string, rewrite bool, run func(cmd string) []string) {
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	var out []string // the file, rewritten
	for i := 0; i < len(lines); i++ {
		out = append(out, lines[i])
		cmd, isCmd := strings.CutPrefix(lines[i], "> ")
		if !isCmd {
			continue
		}
		var want []string
		for i+1 < len(lines) && lines[i+1] != "" && !strings.HasPrefix(lines[i+1], "> ") && !strings.HasPrefix(lines[i+1], "#") {
			i++
			want = append(want, lines[i])
		}
		got := run(cmd)
		out = append(out, got...)
		if !rewrite && !slices.Equal(got, want) {
			t.Errorf("%s:%d: > %s\ngot:\n  %s\nwant:\n  %s", file, i+1, cmd, strings.Join(got, "\n  "), strings.Join(want, "\n  "))
		}
	}
	if rewrite {
		if err := os.WriteFile(file, []byte(strings.Join(out, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
