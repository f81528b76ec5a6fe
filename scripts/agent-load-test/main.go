// agent-load-test runs LiveKit's own agent load tester (the livekit-cli module's pkg/loadtester, the code behind
// `lk perf agent-load-test`) with the same flags. It exists because `lk` itself does not build from the Go module
// proxy at any release that the proxy serves with its dependencies (see scripts/livekit.sh).
package main

import (
	"context"
	"flag"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/livekit/livekit-cli/v2/pkg/loadtester"
)

func main() {
	rooms := flag.Int("rooms", 0, "rooms to create, one after another (each waits for its agent to join)")
	agentName := flag.String("agent-name", "", "the agent to dispatch to each room")
	echoDelay := flag.Duration("echo-speech-delay", 5*time.Second, "delay before the echo participant repeats the agent")
	duration := flag.Duration("duration", 0, "how long the test runs (0: until interrupted)")
	url := flag.String("url", os.Getenv("LIVEKIT_URL"), "LiveKit server URL (LIVEKIT_URL)")
	key := flag.String("api-key", os.Getenv("LIVEKIT_API_KEY"), "API key (LIVEKIT_API_KEY)")
	secret := flag.String("api-secret", os.Getenv("LIVEKIT_API_SECRET"), "API secret (LIVEKIT_API_SECRET)")
	flag.Parse()
	if *rooms <= 0 || *url == "" || *key == "" || *secret == "" {
		log.Fatal("agent-load-test: --rooms N and a server (--url/--api-key/--api-secret or LIVEKIT_*) are required")
	}
	params := loadtester.AgentLoadTestParams{
		Rooms:           *rooms,
		AgentName:       *agentName,
		EchoSpeechDelay: *echoDelay,
		Duration:        *duration,
		URL:             *url,
		APIKey:          *key,
		APISecret:       *secret,
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := loadtester.NewAgentLoadTest(params).Run(ctx, params); err != nil {
		log.Fatal(err)
	}
}
