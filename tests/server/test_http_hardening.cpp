// Attacks on the HTTP layer over real sockets: request smuggling through conflicting framing, chunked bodies
// and their limit, bare-LF requests, HEAD, slow heads, idle-connection floods (per-address and total caps
// with idle eviction), and a handler that throws.
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "server/http.h"
#include "server/socket_client.h"

namespace lily {
namespace {

using Clock = std::chrono::steady_clock;

class HttpHardening : public ::testing::Test {
 protected:
  void start(HttpServerOptions o) {
    o.port = 0;
    o.drain_timeout_ms = 500;  // busy test connections are cut at teardown
    server_ = std::make_unique<HttpServer>(o, [](const HttpRequest& req, HttpExchange& ex) {
      if (req.path == "/throw") throw std::runtime_error("boom");
      ex.send(200, "text/plain", req.method + " " + req.body);
    });
    ASSERT_TRUE(server_->listen().ok());
    thread_ = std::thread([this] { server_->run(); });
  }
  void SetUp() override {
    HttpServerOptions o;
    o.max_body_bytes = 1000;
    start(o);
  }
  void TearDown() override {
    server_->shutdown();
    thread_.join();
  }
  int port() const { return server_->port(); }
  void restart(HttpServerOptions o) {
    TearDown();
    start(o);
  }
  void restart_with_caps(size_t total, size_t per_client) {
    HttpServerOptions o;
    o.max_connections = total;
    o.max_connections_per_client = per_client;
    restart(o);
  }
  // A new connection from `source` is answered at once.
  void expect_answered_from(const char* source) {
    Client c(port(), source);
    auto t0 = Clock::now();
    c.send("GET /health HTTP/1.1\r\nConnection: close\r\n\r\n");
    std::string r = c.read_all();
    EXPECT_TRUE(r.starts_with("HTTP/1.1 200 OK")) << source << ": " << r;
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  }

  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
};

TEST_F(HttpHardening, ConflictingContentLengthsAre400AndTheRestIsNotARequest) {
  Client c(port());
  // Before: the first length framed the body and "GET /smuggled" ran as a second request.
  c.send(
      "POST /echo HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 30\r\n\r\nhelloGET /smuggled "
      "HTTP/1.1\r\n\r\n");
  std::string r = c.read_all();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 400 ")) << r;
  EXPECT_NE(r.find("conflicting Content-Length headers"), std::string::npos) << r;
  EXPECT_EQ(r.find("200 OK"), std::string::npos) << r;
  EXPECT_NE(r.find("Connection: close"), std::string::npos) << r;
}

TEST_F(HttpHardening, EqualContentLengthsAreOneAndMixedFramingIsRefused) {
  {
    Client c(port());
    c.send(
        "POST /echo HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5, 5\r\nConnection: close\r\n\r\nhello");
    EXPECT_TRUE(c.read_all().ends_with("POST hello"));
  }
  {
    Client c(port());
    c.send(
        "POST /echo HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: "
        "chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
    std::string r = c.read_all();
    EXPECT_TRUE(r.starts_with("HTTP/1.1 400 ")) << r;
  }
  {
    Client c(port());
    c.send("POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n");
    EXPECT_TRUE(c.read_all().starts_with("HTTP/1.1 400 "));
  }
  {
    Client c(port());
    c.send("POST /echo HTTP/1.1\r\nContent-Length : 5\r\n\r\nhello");  // whitespace before the colon
    EXPECT_TRUE(c.read_all().starts_with("HTTP/1.1 400 "));
  }
}

TEST_F(HttpHardening, ChunkedBodiesAreDecodedUnderTheBodyLimit) {
  {
    Client c(port());  // extensions and trailers, split across sends, then a pipelined request
    c.send("POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nhel\r\n");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    c.send("2\r\nlo\r\n0\r\nX-Trailer: t\r\n\r\nGET /next HTTP/1.1\r\nConnection: close\r\n\r\n");
    std::string r = c.read_all();
    EXPECT_NE(r.find("Content-Length: 10\r\n\r\nPOST hello"), std::string::npos) << r;
    EXPECT_TRUE(r.ends_with("GET ")) << r;
  }
  {
    Client c(port());
    std::string big(600, 'x');
    c.send("POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n258\r\n" + big + "\r\n258\r\n" + big +
           "\r\n0\r\n\r\n");
    std::string r = c.read_all();
    EXPECT_TRUE(r.starts_with("HTTP/1.1 413 ")) << r;
    EXPECT_NE(r.find("exceeds the limit of 1000 bytes"), std::string::npos) << r;
  }
  {
    Client c(port());
    c.send("POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n");
    EXPECT_TRUE(c.read_all().starts_with("HTTP/1.1 400 "));
  }
}

TEST_F(HttpHardening, BareLfRequestsAreAnswered) {
  Client c(port());
  auto t0 = Clock::now();
  c.send("POST /echo HTTP/1.1\nContent-Length: 2\nConnection: close\n\nhi");
  std::string r = c.read_all();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 200 OK\r\n")) << r;
  EXPECT_TRUE(r.ends_with("POST hi")) << r;
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));  // before: no answer until the 30 s I/O timeout
}

TEST_F(HttpHardening, HeadSendsTheHeadersOfGetWithoutTheBody) {
  Client c(port());
  c.send("HEAD /x HTTP/1.1\r\n\r\nGET /x HTTP/1.1\r\nConnection: close\r\n\r\n");
  std::string r = c.read_all();
  // HEAD's Content-Length is that of its own body ("HEAD "); then the GET's response follows on the same
  // connection, so nothing was sent after the HEAD response's headers.
  EXPECT_TRUE(r.starts_with(
      "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nHTTP/1.1 200 OK"))
      << r;
  EXPECT_TRUE(r.ends_with("GET ")) << r;
}

TEST_F(HttpHardening, AThrowingHandlerGets500JsonAndTheServerGoesOn) {
  {
    Client c(port());
    c.send("GET /throw HTTP/1.1\r\n\r\n");
    std::string r = c.read_all();
    EXPECT_TRUE(r.starts_with("HTTP/1.1 500 ")) << r;
    EXPECT_NE(r.find(R"("type":"server_error","param":null,"code":"internal_error")"), std::string::npos)
        << r;
  }
  Client c(port());
  c.send("GET /ok HTTP/1.1\r\nConnection: close\r\n\r\n");
  EXPECT_TRUE(c.read_all().starts_with("HTTP/1.1 200 OK"));
}

TEST_F(HttpHardening, ASlowHeadGets408) {
  HttpServerOptions o;
  o.header_timeout_ms = 300;
  restart(o);
  Client c(port());
  c.send("GET /x HTTP/1.1\r\nX-Slow: ");
  auto t0 = Clock::now();
  std::string r = c.read_all();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 408 ")) << r;
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3));
}

// Before: 512 idle connections took every slot and everyone, /health included, got 503 for a minute.
TEST_F(HttpHardening, AnIdleFloodFromOneAddressLocksNobodyOut) {
  restart_with_caps(40, 8);
  std::vector<std::unique_ptr<Client>> flood;
  for (int i = 0; i < 120; ++i) flood.push_back(std::make_unique<Client>(port()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_LE(server_->connections(), 9u);  // the flood's oldest connections were closed to make room
  expect_answered_from("127.0.0.1");
  expect_answered_from("127.0.0.2");
  EXPECT_GE(server_->evicted_connections(), 100u);
}

TEST_F(HttpHardening, AnIdleFloodFromManyAddressesLocksNobodyOut) {
  restart_with_caps(16, 8);
  std::vector<std::unique_ptr<Client>> flood;
  for (const char* from : {"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"}) {
    for (int i = 0; i < 8; ++i) flood.push_back(std::make_unique<Client>(port(), from));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_LE(server_->connections(), 17u);
  expect_answered_from("127.0.0.9");
}

TEST_F(HttpHardening, BusyConnectionsAreNotEvictedAndPastTheCapThe503Says) {
  restart_with_caps(512, 4);
  std::vector<std::unique_ptr<Client>> busy;
  for (int i = 0; i < 4; ++i) {  // each is reading its body: a request in progress
    busy.push_back(std::make_unique<Client>(port()));
    busy.back()->send("POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc");
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  Client extra(port());
  std::string r = extra.read_all();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 503 ")) << r;
  EXPECT_NE(r.find("too_many_connections"), std::string::npos) << r;
  busy[0]->send("defghij");  // the busy ones were left alone
  EXPECT_TRUE(busy[0]->read_until("POST abcdefghij").ends_with("POST abcdefghij"));
}

}  // namespace
}  // namespace lily
