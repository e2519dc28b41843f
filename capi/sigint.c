// The SIGINT chain of the C ABI (signal.go).

#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

// The SIGINT chain (see "Threading" in the package doc): note the signal
// on a pipe that a goroutine reads, then run the handler that was there
// before (Python's, which makes the interpreter raise KeyboardInterrupt).
// Only async-signal-safe calls here.
static struct sigaction ft_prev;
static volatile int ft_wr = -1;
static volatile pid_t ft_pid;

static void ft_on_sigint(int sig, siginfo_t* info, void* uc) {
	// The previous handler first: Python's marks the signal pending, so
	// that the call Go is about to end finds it when it returns to Python.
	if (ft_prev.sa_flags & SA_SIGINFO) {
		if (ft_prev.sa_sigaction) ft_prev.sa_sigaction(sig, info, uc);
	} else if (ft_prev.sa_handler == SIG_DFL) {
		struct sigaction dfl;
		memset(&dfl, 0, sizeof dfl);
		dfl.sa_handler = SIG_DFL;
		sigaction(sig, &dfl, NULL);
		raise(sig);
		return;
	} else if (ft_prev.sa_handler != SIG_IGN && ft_prev.sa_handler) {
		ft_prev.sa_handler(sig);
	}
	if (ft_wr >= 0 && getpid() == ft_pid) { // not in a forked child
		char b = 1;
		ssize_t r = write(ft_wr, &b, 1);
		(void)r;
	}
}

// ft_sigint_install puts ft_on_sigint in front of the current handler
// unless it is already there: 1 installed, 0 already, -1 error.
int ft_sigint_install(int wr) {
	struct sigaction cur;
	if (sigaction(SIGINT, NULL, &cur) != 0) return -1;
	if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == ft_on_sigint) return 0;
	ft_prev = cur;
	ft_wr = wr;
	ft_pid = getpid();
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_sigaction = ft_on_sigint;
	sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
	sigemptyset(&sa.sa_mask);
	return sigaction(SIGINT, &sa, NULL) == 0 ? 1 : -1;
}

int ft_sigint_installed(void) {
	struct sigaction cur;
	if (sigaction(SIGINT, NULL, &cur) != 0) return 0;
	return (cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == ft_on_sigint;
}
